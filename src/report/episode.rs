//! `weir inspect RUN --episode STEP:ROW`: one rollout row read back from the
//! log, turn by turn, without the environment or the tools. The model's
//! tokens, the template's boundaries and the observations are on lines of
//! their own, each marked with what it is:
//! - `model ▸`: the model's own tokens;
//! - `· boundary`: the template's tokens;
//! - `◂ observation`: what a tool or the environment said.
//!
//! After each turn of the model come its log-probs and its environment
//! reward, and after the turns, every tool call with its output.

use std::path::Path;

use anyhow::{bail, Context};
use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{Float32Type, Int64Type, UInt32Type, UInt64Type, UInt8Type};
use weir_gpu::Tokenizer;
use weir_graph::parquet_log::read_parquet_dir;
use weir_operators::rollout::{col, TokenKind};

/// What `spec` (`STEP:ROW`) names, rendered.
pub fn episode(run_dir: &Path, spec: &str) -> anyhow::Result<String> {
    let (step, row) = parse_spec(spec)?;
    let (_, cfg) = weir_pipelines::runner::read_resolved(run_dir)?;
    let tokenizer = Tokenizer::load(&cfg.model.path).with_context(|| {
        format!(
            "the run's tokenizer (model.path {})",
            cfg.model.path.display()
        )
    })?;
    let batches = read_parquet_dir(&run_dir.join("rollouts"))
        .with_context(|| format!("{}/rollouts", run_dir.display()))?;
    // The step's rows in (group, sample) order, whatever order they were written in.
    let mut rows: Vec<(u64, u32, &RecordBatch, usize)> = Vec::new();
    for b in &batches {
        let steps = b
            .column_by_name(col::STEP)
            .context("the log has no step column")?
            .as_primitive::<UInt64Type>();
        let groups = b.column_by_name(col::GROUP_ID).context("no group_id")?;
        let samples = b.column_by_name(col::SAMPLE_IDX).context("no sample_idx")?;
        for i in 0..b.num_rows() {
            if steps.value(i) == step {
                rows.push((
                    groups.as_primitive::<UInt64Type>().value(i),
                    samples.as_primitive::<UInt32Type>().value(i),
                    b,
                    i,
                ));
            }
        }
    }
    rows.sort_by_key(|&(g, s, _, _)| (g, s));
    let Some(&(group, sample, batch, i)) = rows.get(row) else {
        bail!(
            "--episode {spec}: step {step} has {} rows in {}/rollouts",
            rows.len(),
            run_dir.display()
        );
    };
    render(&tokenizer, batch, i, step, row, group, sample)
}

fn parse_spec(spec: &str) -> anyhow::Result<(u64, usize)> {
    let parsed = spec
        .split_once(':')
        .and_then(|(s, r)| Some((s.parse().ok()?, r.parse().ok()?)));
    parsed.with_context(|| format!("--episode {spec:?}: expected STEP:ROW, e.g. 3:0"))
}

/// Column `name`'s list at row `i`, as the values of `T`; empty when the
/// column is absent or the row null.
fn list<T: arrow::datatypes::ArrowPrimitiveType>(
    b: &RecordBatch,
    name: &str,
    i: usize,
) -> Vec<Option<T::Native>> {
    let Some(c) = b.column_by_name(name) else {
        return Vec::new();
    };
    let l = c.as_list::<i32>();
    if l.is_null(i) {
        return Vec::new();
    }
    let v = l.value(i);
    let v = v.as_primitive::<T>();
    (0..v.len())
        .map(|j| v.is_valid(j).then(|| v.value(j)))
        .collect()
}

fn text(b: &RecordBatch, name: &str, i: usize) -> Option<String> {
    let c = b.column_by_name(name)?;
    let s = c.as_string_opt::<i32>()?;
    s.is_valid(i).then(|| s.value(i).to_string())
}

fn render(
    tokenizer: &Tokenizer,
    b: &RecordBatch,
    i: usize,
    step: u64,
    row: usize,
    group: u64,
    sample: u32,
) -> anyhow::Result<String> {
    use std::fmt::Write;
    let tokens: Vec<i64> = list::<Int64Type>(b, col::RESPONSE_TOKENS, i)
        .into_iter()
        .flatten()
        .collect();
    let kinds: Vec<u8> = list::<UInt8Type>(b, col::TOKEN_KINDS, i)
        .into_iter()
        .flatten()
        .collect();
    let turns: Vec<u32> = list::<UInt32Type>(b, col::TOKEN_TURNS, i)
        .into_iter()
        .flatten()
        .collect();
    let logprobs = list::<Float32Type>(b, col::BEHAVIOR_LOGPROBS, i);
    let env = list::<Float32Type>(b, col::ENV_REWARDS, i);
    let reward = b
        .column_by_name(col::REWARD)
        .map(|c| c.as_primitive::<Float32Type>().value(i));
    let mut out = String::new();
    let finish = text(b, col::FINISH_REASON, i).unwrap_or_default();
    writeln!(
        out,
        "episode: step {step}, row {row} (group {group}, sample {sample}); finish {finish}; reward {}",
        reward.map_or("—".into(), |r| r.to_string())
    )?;
    let prompt: Vec<i64> = list::<Int64Type>(b, col::PROMPT_TOKENS, i)
        .into_iter()
        .flatten()
        .collect();
    writeln!(out, "prompt ({} tokens):", prompt.len())?;
    for line in tokenizer.decode(&prompt, false)?.lines() {
        writeln!(out, "    {line}")?;
    }
    // Spans of one kind and turn, in order.
    let kind_of = |j: usize| kinds.get(j).copied().unwrap_or(TokenKind::Generated as u8);
    let turn_of = |j: usize| turns.get(j).copied().unwrap_or(0);
    let mut start = 0;
    while start < tokens.len() {
        let (kind, turn) = (kind_of(start), turn_of(start));
        let mut end = start + 1;
        while end < tokens.len() && kind_of(end) == kind && turn_of(end) == turn {
            end += 1;
        }
        let shown = tokenizer.decode(&tokens[start..end], false)?;
        let label = match kind {
            k if k == TokenKind::Observation as u8 => "    ◂ observation".to_string(),
            k if k == TokenKind::Boundary as u8 => "    · boundary".to_string(),
            _ => format!("turn {turn} model ▸"),
        };
        writeln!(out, "{label} ({} tokens): {shown:?}", end - start)?;
        if kind == TokenKind::Generated as u8 {
            let lp: Vec<f32> = logprobs[start..end.min(logprobs.len())]
                .iter()
                .flatten()
                .copied()
                .collect();
            let mean = lp.iter().sum::<f32>() / lp.len().max(1) as f32;
            let turn_reward: f32 = env[start.min(env.len())..end.min(env.len())]
                .iter()
                .flatten()
                .sum();
            let env_part = if env.is_empty() {
                String::new()
            } else {
                format!(", environment reward {turn_reward}")
            };
            writeln!(out, "    log-prob mean {mean:.4}{env_part}")?;
        }
        start = end;
    }
    if let Some(calls) = text(b, "tool_calls", i) {
        let calls: Vec<serde_json::Value> = serde_json::from_str(&calls).unwrap_or_default();
        if !calls.is_empty() {
            writeln!(out, "tool calls:")?;
        }
        for c in calls {
            writeln!(
                out,
                "  turn {} {} {} → {:?} ({}, {:.3} s)",
                c["turn"],
                c["tool"]
                    .as_str()
                    .filter(|t| !t.is_empty())
                    .unwrap_or("(unread)"),
                c["arguments"].as_str().unwrap_or(""),
                c["output"].as_str().unwrap_or(""),
                if c["ok"] == true { "ok" } else { "failed" },
                c["seconds"].as_f64().unwrap_or(0.0)
            )?;
        }
    }
    if let Some(error) = text(b, "env_error", i) {
        writeln!(out, "environment error: {error}")?;
    }
    let count = |k: TokenKind| kinds.iter().filter(|&&x| x == k as u8).count();
    if kinds.is_empty() {
        writeln!(
            out,
            "tokens: {} generated (a single response)",
            tokens.len()
        )?;
    } else {
        writeln!(
            out,
            "tokens: {} generated, {} observation, {} boundary",
            count(TokenKind::Generated),
            count(TokenKind::Observation),
            count(TokenKind::Boundary)
        )?;
    }
    Ok(out)
}
