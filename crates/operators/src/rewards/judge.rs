//! `Judge`: rewards from a generative judge model. Each row's prompt,
//! response, label and prompt-file columns fill a minijinja template; the
//! judge (a causal LM, through weir's own generator) answers it, and a
//! verdict rule turns the answer into the reward: the first capture group
//! of a regex, read as a number, or the probability the judge gives a set
//! of verdict tokens at its first generated position. The judge's text is
//! logged (`judge_response`).

use std::collections::BTreeSet;
use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, StringArray};
use regex::Regex;
use tch::{Kind, Tensor};
use weir_gpu::{Backend, Model, SamplingParams, Tokenizer};
use weir_graph::batch::with_column;
use weir_graph::{Stage, StageError, StepContext};

use super::rules;
use crate::data::columns::{strings, u32s, u64s, with_rewards};
use crate::rollout::col;

/// How the judge's answer becomes a reward.
#[derive(Clone, Debug)]
pub enum Verdict {
    /// The first capture group of the pattern's first match in the judge's
    /// text, read as a number.
    Regex(Regex),
    /// `Σ p(token)` over these token ids at the judge's first generated
    /// position (the judge generates nothing).
    Probability(Vec<i64>),
}

impl Verdict {
    /// A regex verdict; the pattern must compile and hold a capture group.
    pub fn regex(pattern: &str) -> Result<Self, String> {
        let re = Regex::new(pattern).map_err(|e| format!("does not compile: {e}"))?;
        if re.captures_len() < 2 {
            return Err("has no capture group: put the verdict's number in ( )".into());
        }
        Ok(Verdict::Regex(re))
    }

    /// A probability verdict over `tokens`, each of which `tokenizer` must
    /// read as one token.
    pub fn probability(tokenizer: &Tokenizer, tokens: &[String]) -> Result<Self, String> {
        if tokens.is_empty() {
            return Err("is empty: name the token(s) whose probability is the reward".into());
        }
        let mut ids = Vec::with_capacity(tokens.len());
        for token in tokens {
            let encoded = tokenizer
                .encode(token, false)
                .map_err(|e| format!("{token:?}: {e}"))?;
            match encoded[..] {
                [id] => ids.push(id),
                _ => {
                    let pieces = tokenizer.tokens(token).unwrap_or_default();
                    return Err(format!(
                        "{token:?} is {} tokens to the judge's tokenizer ({pieces:?}): a verdict token must be one",
                        encoded.len()
                    ));
                }
            }
        }
        Ok(Verdict::Probability(ids))
    }

    /// The number in `text`, if the pattern finds one.
    fn parse(re: &Regex, text: &str) -> Option<f64> {
        let found = re.captures(text)?.get(1)?.as_str().trim();
        found.parse::<f64>().ok().filter(|v| v.is_finite())
    }
}

/// What a judge needs besides its model.
#[derive(Clone, Debug)]
pub struct JudgeConfig {
    /// The minijinja template of the judge's prompt.
    pub template: String,
    /// Render the template as a user message through the judge
    /// tokenizer's chat template (else the text is the judge's prompt).
    pub chat: bool,
    /// How the answer becomes a reward.
    pub verdict: Verdict,
    /// The judge's sampling (its own `max_new_tokens`; greedy or sampled).
    pub params: SamplingParams,
    /// Which implementation generates.
    pub backend: Backend,
    /// The reward of an answer the verdict rule does not parse (`None`: an
    /// error naming the row and the judge's text).
    pub unparsed: Option<f64>,
    /// The column of the reference answer, given to the template as `label`.
    pub label_column: Option<String>,
    /// The names the template may use besides `prompt`, `response` and
    /// `label`: the prompt file's columns.
    pub columns: Vec<String>,
    /// Rows per forward pass of a probability verdict.
    pub micro_batch: usize,
}

/// A judge model and its rule.
pub struct Judge {
    model: Model,
    tokenizer: Tokenizer,
    env: std::sync::Arc<minijinja::Environment<'static>>,
    cfg: JudgeConfig,
}

/// The names a judge template reads beside the prompt file's columns.
pub const TEMPLATE_NAMES: &[&str] = &["prompt", "response", "label"];

/// A judge template compiled, undefined names an error when it renders,
/// with a chat template's fuel (its memory bound is kept by [`Judge`]'s
/// rendering, as [`weir_gpu::tokenizer::CHAT_BYTES`]).
pub fn compile(template: &str) -> Result<minijinja::Environment<'static>, String> {
    let mut env = minijinja::Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    env.set_fuel(Some(weir_gpu::tokenizer::CHAT_FUEL));
    env.add_template_owned("judge", template.to_string())
        .map_err(|e| format!("does not compile: {e}"))?;
    Ok(env)
}

/// Checks a judge's `template` and `chat` setting before anything runs:
/// the template compiles and names nothing but [`TEMPLATE_NAMES`] and
/// `columns` (`label` only with a label column), and a chat judge's
/// tokenizer has a chat template. Returns the compiled template.
pub fn check(
    template: &str,
    columns: &[String],
    has_label: bool,
    chat: bool,
    tokenizer: &Tokenizer,
) -> Result<minijinja::Environment<'static>, String> {
    if chat && tokenizer.chat_template().is_none() {
        return Err(
            "judge.chat: the judge's tokenizer has no chat template (judge.chat = false gives it the text as is)"
                .into(),
        );
    }
    let env = compile(template).map_err(|e| format!("judge.template: {e}"))?;
    let compiled = env.get_template("judge").map_err(|e| e.to_string())?;
    let known: BTreeSet<&str> = TEMPLATE_NAMES
        .iter()
        .copied()
        .chain(columns.iter().map(String::as_str))
        .collect();
    let named = compiled.undeclared_variables(false);
    if let Some(name) = named.iter().find(|v| !known.contains(v.as_str())) {
        return Err(format!(
            "judge.template: names `{name}`, which is none of {known:?} (the prompt, the response, the label and the prompt file's columns)"
        ));
    }
    if !has_label && named.contains("label") {
        return Err("judge.template: names `label`, but data.label_column is empty".into());
    }
    Ok(env)
}

impl Judge {
    /// A judge over `model` and its tokenizer, its template and chat
    /// setting as [`check`] holds them.
    pub fn new(model: Model, tokenizer: Tokenizer, cfg: JudgeConfig) -> Result<Self, String> {
        let env = check(
            &cfg.template,
            &cfg.columns,
            cfg.label_column.is_some(),
            cfg.chat,
            &tokenizer,
        )?;
        Ok(Judge {
            model,
            tokenizer,
            env: std::sync::Arc::new(env),
            cfg,
        })
    }

    /// The judge's prompt for each row of `batch`.
    fn prompts(&self, batch: &RecordBatch, stage: &str) -> Result<Vec<Vec<i64>>, StageError> {
        // A prompt the chat template rendered is given as its conversation's text.
        let prompts: Vec<String> = crate::data::columns::row_conversations(batch, stage)?
            .iter()
            .map(|messages| crate::data::columns::plain_prompt(messages))
            .collect();
        let responses = strings(batch, col::RESPONSE, stage)?;
        let labels = match &self.cfg.label_column {
            Some(name) => Some(strings(batch, name, stage)?),
            None => None,
        };
        let mut columns = Vec::new();
        for name in &self.cfg.columns {
            if batch.column_by_name(name).is_some() {
                columns.push((name.as_str(), strings(batch, name, stage)?));
            }
        }
        let mut out = Vec::with_capacity(batch.num_rows());
        for row in 0..batch.num_rows() {
            let mut values = serde_json::Map::new();
            for (name, texts) in &columns {
                values.insert(name.to_string(), texts[row].clone().into());
            }
            values.insert("prompt".into(), prompts[row].clone().into());
            values.insert(
                "response".into(),
                rules::completion(&responses[row]).to_string().into(),
            );
            if let Some(labels) = &labels {
                values.insert("label".into(), labels[row].clone().into());
            }
            let env = std::sync::Arc::clone(&self.env);
            let values = minijinja::Value::from_serialize(serde_json::Value::Object(values));
            let text =
                weir_gpu::memory_budget::within(weir_gpu::tokenizer::CHAT_BYTES, move || {
                    env.get_template("judge")
                        .and_then(|template| template.render(values))
                        .map_err(|e| e.to_string())
                })
                .map_err(|over| format!("judge.template: row {row}: rendering {over}"))?
                .map_err(|e| format!("judge.template: row {row}: {e}"))?;
            let ids = if self.cfg.chat {
                let message = weir_gpu::tokenizer::Message {
                    role: "user".into(),
                    content: text,
                };
                self.tokenizer.encode_chat(&[message], true)?
            } else {
                self.tokenizer.encode(&text, false)?
            };
            if ids.is_empty() {
                return Err(
                    format!("judge.template: row {row}: the judge's prompt is empty").into(),
                );
            }
            out.push(ids);
        }
        Ok(out)
    }

    /// Each row's reward and the judge's text, and how many rows did not parse.
    pub fn judge(
        &mut self,
        batch: &RecordBatch,
        stage: &str,
    ) -> Result<(Vec<f64>, Vec<String>, usize), StageError> {
        let prompts = self.prompts(batch, stage)?;
        match &self.cfg.verdict {
            Verdict::Regex(re) => {
                let groups = u64s(batch, col::GROUP_ID, stage)?;
                let samples = u32s(batch, col::SAMPLE_IDX, stage)?;
                // Each row's own random stream: its group and sample.
                let streams: Vec<u64> = groups
                    .iter()
                    .zip(&samples)
                    .map(|(g, s)| g.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(*s))
                    .collect();
                let params = SamplingParams {
                    n: 1,
                    ..self.cfg.params.clone()
                };
                let out = weir_gpu::generate::generate_on(
                    &self.model,
                    &prompts,
                    &streams,
                    &params,
                    self.cfg.backend,
                )?;
                let (mut rewards, mut texts, mut unparsed) = (Vec::new(), Vec::new(), 0);
                for (row, g) in out.iter().enumerate() {
                    let text = self.tokenizer.decode(&g.tokens, true)?;
                    let reward = match (Verdict::parse(re, &text), self.cfg.unparsed) {
                        (Some(v), _) => v,
                        (None, Some(fallback)) => {
                            unparsed += 1;
                            fallback
                        }
                        (None, None) => {
                            return Err(format!(
                                "judge: row {row}: the verdict pattern `{}` finds no number in the judge's answer {text:?} (judge.on_unparsed = \"reward\" scores such rows with judge.unparsed_reward)",
                                re.as_str()
                            )
                            .into())
                        }
                    };
                    rewards.push(reward);
                    texts.push(text);
                }
                Ok((rewards, texts, unparsed))
            }
            Verdict::Probability(tokens) => {
                let (rewards, texts) = self.probabilities(&prompts, tokens)?;
                if let Some(row) = rewards.iter().position(|p| !p.is_finite()) {
                    return Err(format!(
                        "judge: row {row}: the verdict tokens' probability is {}: the judge's output overflows",
                        rewards[row]
                    )
                    .into());
                }
                Ok((rewards, texts, 0))
            }
        }
    }

    /// `Σ p(token)` over `tokens` at each prompt's next position, and the
    /// judge's most likely token there.
    fn probabilities(
        &self,
        prompts: &[Vec<i64>],
        tokens: &[i64],
    ) -> Result<(Vec<f64>, Vec<String>), StageError> {
        let _guard = tch::no_grad_guard();
        let device = self.model.device();
        let wanted = Tensor::from_slice(tokens).to_device(device);
        let (mut rewards, mut texts) = (Vec::new(), Vec::new());
        for chunk in prompts.chunks(self.cfg.micro_batch.max(1)) {
            // Right-padded: a causal row's last real position never sees the padding.
            let width = chunk.iter().map(Vec::len).max().unwrap_or(0);
            let mut ids = vec![0i64; chunk.len() * width];
            for (r, p) in chunk.iter().enumerate() {
                ids[r * width..r * width + p.len()].copy_from_slice(p);
            }
            let ids = Tensor::from_slice(&ids)
                .view([chunk.len() as i64, width as i64])
                .to_device(device);
            let hidden = self.model.hidden_states(&ids, None, None)?;
            let last: Vec<i64> = chunk.iter().map(|p| p.len() as i64 - 1).collect();
            let last = Tensor::from_slice(&last).to_device(device);
            let rows = Tensor::arange(chunk.len() as i64, (Kind::Int64, device));
            let states = hidden.index(&[Some(rows), Some(last)]);
            let logp = self
                .model
                .lm_logits(&states)?
                .to_kind(Kind::Double)
                .log_softmax(-1, Kind::Double);
            let p = logp
                .index_select(1, &wanted)
                .exp()
                .sum_dim_intlist(-1, false, Kind::Double);
            rewards.extend(Vec::<f64>::try_from(&p).map_err(|e| e.to_string())?);
            let top = Vec::<i64>::try_from(logp.argmax(-1, false)).map_err(|e| e.to_string())?;
            for t in top {
                texts.push(self.tokenizer.decode(&[t], false)?);
            }
        }
        Ok((rewards, texts))
    }
}

/// `reward.kind = "judge"`: the judge's verdict is each row's reward.
pub struct JudgeReward(pub Judge);

impl Stage for JudgeReward {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let started = std::time::Instant::now();
        let (rewards, texts, unparsed) = self.0.judge(&batch, ctx.stage())?;
        record(ctx, batch.num_rows(), unparsed, started);
        let batch = with_rewards(&batch, &rewards)?;
        Ok(vec![with_judge_texts(&batch, texts)?])
    }
}

/// The judge's metrics of a batch: the share of unparsed verdicts and its seconds.
pub(crate) fn record(
    ctx: &mut StepContext,
    rows: usize,
    unparsed: usize,
    started: std::time::Instant,
) {
    if rows > 0 {
        ctx.record("judge_unparsed", unparsed as f64 / rows as f64);
        ctx.record("judge_s", started.elapsed().as_secs_f64());
    }
}

/// `batch` with the judge's text of each row.
pub(crate) fn with_judge_texts(
    batch: &RecordBatch,
    texts: Vec<String>,
) -> Result<RecordBatch, StageError> {
    Ok(with_column(
        batch,
        col::JUDGE_RESPONSE,
        Arc::new(StringArray::from(texts)) as ArrayRef,
    )?)
}
