//! `RewardTerms`: several rewards combined with weights, as TRL's
//! `reward_funcs` + `reward_weights`: `reward = Σ weightᵢ · termᵢ`. Each
//! term's mean over the batch is recorded as the metric `reward_<name>`.

use arrow::array::RecordBatch;
use regex::Regex;
use weir_graph::{Stage, StageError, StepContext};

use super::python::PythonReward;
use super::rules;
use super::{check_scores, Reward, RewardRows, RuleReward};
use crate::data::columns::{float_list_array, strings, token_lists, with_rewards};
use crate::rollout::col;
use weir_graph::batch::with_column;

/// What one term computes.
pub enum TermKind {
    /// A rule on the response and the reference answer.
    Rule(RuleReward),
    /// 1 when the pattern matches the whole completion ([`rules::full_match`]).
    Regex(Regex),
    /// [`rules::length_penalty`] of the response's tokens against `max`.
    Length {
        /// The length at which the penalty reaches −1.
        max: usize,
    },
    /// A Python reward function.
    Python(Box<PythonReward>),
    /// A reward written in Rust, registered by the user's binary.
    Custom(Box<dyn Reward>),
    /// A generative judge's verdict (its answers logged as `judge_response`).
    Judge(Box<super::judge::Judge>),
}

/// One weighted term.
pub struct Term {
    /// Its metric is `reward_<name>`.
    pub name: String,
    /// Its weight in the sum.
    pub weight: f64,
    /// What it computes.
    pub kind: TermKind,
}

/// The weighted sum of several rewards.
pub struct RewardTerms {
    terms: Vec<Term>,
    label_column: String,
}

impl RewardTerms {
    /// The sum of `terms`; rules read their reference from `label_column`.
    pub fn new(terms: Vec<Term>, label_column: &str) -> Result<Self, StageError> {
        if terms.is_empty() {
            return Err("reward terms: none given".into());
        }
        Ok(RewardTerms {
            terms,
            label_column: label_column.to_string(),
        })
    }
}

impl Stage for RewardTerms {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let n = batch.num_rows();
        let responses = strings(&batch, col::RESPONSE, ctx.stage())?;
        let needs_labels = self.terms.iter().any(|t| {
            !matches!(
                t.kind,
                TermKind::Regex(_) | TermKind::Length { .. } | TermKind::Judge(_)
            )
        });
        let labels = match (needs_labels, self.label_column.is_empty()) {
            (true, false) => Some(strings(&batch, &self.label_column, ctx.stage())?),
            _ => None,
        };
        let mut total = vec![0.0; n];
        let mut scores = vec![Vec::with_capacity(self.terms.len()); n];
        let mut judged = None;
        for term in &mut self.terms {
            let values: Vec<f64> = match &mut term.kind {
                TermKind::Rule(rule) => {
                    let labels = labels.as_ref().ok_or_else(|| {
                        format!(
                            "reward term `{}`: a rule needs data.label_column",
                            term.name
                        )
                    })?;
                    responses
                        .iter()
                        .zip(labels)
                        .map(|(r, l)| rule(r, l))
                        .collect()
                }
                TermKind::Regex(pattern) => responses
                    .iter()
                    .map(|r| rules::regex_match(pattern, r))
                    .collect(),
                TermKind::Length { max } => token_lists(&batch, col::RESPONSE_TOKENS, ctx.stage())?
                    .iter()
                    .map(|t| rules::length_penalty(t.len(), *max))
                    .collect(),
                TermKind::Python(python) => {
                    let (values, logs) = python.score_batch(&batch, ctx.stage())?;
                    for (key, value) in logs {
                        ctx.record(&format!("reward_{}_{key}", term.name), value);
                    }
                    values
                }
                TermKind::Custom(reward) => {
                    let prompts = strings(&batch, col::PROMPT, ctx.stage())?;
                    let scores = reward.score(&RewardRows {
                        prompts: &prompts,
                        responses: &responses,
                        labels: labels.as_deref(),
                        batch: &batch,
                    })?;
                    check_scores(&term.name, &scores, n)?;
                    for (key, value) in scores.metrics {
                        ctx.record(&format!("reward_{}_{key}", term.name), value);
                    }
                    scores.rewards
                }
                TermKind::Judge(judge) => {
                    let started = std::time::Instant::now();
                    let (rewards, texts, unparsed) = judge.judge(&batch, ctx.stage())?;
                    super::judge::record(ctx, n, unparsed, started);
                    judged = Some(texts);
                    rewards
                }
            };
            if n > 0 {
                ctx.record(
                    &format!("reward_{}", term.name),
                    values.iter().sum::<f64>() / n as f64,
                );
            }
            for ((sum, row), v) in total.iter_mut().zip(&mut scores).zip(&values) {
                *sum += term.weight * v;
                row.push(*v);
            }
        }
        let mut batch = with_rewards(&batch, &total)?;
        if let Some(texts) = judged {
            batch = super::judge::with_judge_texts(&batch, texts)?;
        }
        Ok(vec![with_column(
            &batch,
            col::REWARD_TERMS,
            float_list_array(&scores),
        )?])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{ArrayRef, Float32Array};
    use std::sync::Arc;
    use weir_graph::WorkerInfo;

    #[test]
    fn terms_sum_with_their_weights() {
        let batch = RecordBatch::try_from_iter([
            (
                col::RESPONSE,
                Arc::new(arrow::array::StringArray::from(vec![
                    "<answer>3</answer>",
                    "3",
                    "<answer>4</answer>",
                ])) as ArrayRef,
            ),
            (
                "answer",
                Arc::new(arrow::array::StringArray::from(vec![
                    "<answer>3</answer>",
                    "3",
                    "3",
                ])) as ArrayRef,
            ),
            (
                col::RESPONSE_TOKENS,
                crate::data::columns::token_list_array(&[vec![1, 2], vec![1], vec![1, 2, 3, 4]]),
            ),
        ])
        .unwrap();
        let terms = vec![
            Term {
                name: "exact".into(),
                weight: 1.0,
                kind: TermKind::Rule(rules::exact),
            },
            Term {
                name: "format".into(),
                weight: 0.5,
                kind: TermKind::Regex(rules::full_match("<answer>.*</answer>").unwrap()),
            },
            Term {
                name: "length".into(),
                weight: 0.1,
                kind: TermKind::Length { max: 4 },
            },
        ];
        let mut stage = RewardTerms::new(terms, "answer").unwrap();
        let info = WorkerInfo::single();
        let mut ctx = StepContext::detached(0, info, 0);
        let out = stage.process(&mut ctx, batch).unwrap().remove(0);
        let rewards: Vec<f32> = out
            .column_by_name(col::REWARD)
            .unwrap()
            .as_any()
            .downcast_ref::<Float32Array>()
            .unwrap()
            .values()
            .to_vec();
        let want = [1.0 + 0.5 - 0.05, 1.0 + 0.0 - 0.025, 0.0 + 0.5 - 0.1];
        for (got, want) in rewards.iter().zip(want) {
            assert!((f64::from(*got) - want).abs() < 1e-6, "{rewards:?}");
        }
        // Each term's own score, unweighted, in the terms' order.
        let scores = crate::data::columns::float_lists(&out, col::REWARD_TERMS, "t").unwrap();
        let want = [[1.0, 1.0, -0.5], [1.0, 0.0, -0.25], [0.0, 1.0, -1.0]];
        for (got, want) in scores.iter().zip(want) {
            assert_eq!(got.len(), 3);
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() < 1e-6, "{scores:?}");
            }
        }
        assert!(RewardTerms::new(Vec::new(), "answer").is_err());
    }
}
