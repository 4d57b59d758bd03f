//! On-policy distillation: the student samples, a teacher scores every
//! sampled token ([`super::reference::RefLogprob`] writing
//! `teacher_logprobs`), and each token's advantage is the teacher's
//! log-prob of it less the student's,
//!
//! ```text
//! A_t = coef · (log π_teacher(y_t | y_<t) − log π_student(y_t | y_<t))  [+ the task's advantage]
//! ```
//!
//! so a policy-gradient step lowers the reverse KL to the teacher on the
//! student's own samples (Agarwal et al., "On-Policy Distillation of
//! Language Models", 2024, the reverse-KL case of GKD; the per-token
//! advantage as Thinking Machines' on-policy distillation and TRL's
//! `GKDTrainer` with `lmbda = 1, beta = 1` take it, without a discount: each
//! token's term is its own). The student's log-probs are the behaviour
//! log-probs its generator sampled with. A task advantage already written
//! (a group estimator before this stage) is added to, with the
//! distillation term scaled by `coef` (`algorithm.distill_coef`).
//! Observation tokens of an episode take no term.
//!
//! Records `teacher_kl`: the mean over the step's generated tokens of
//! log π_student − log π_teacher, the reverse KL's k1 estimate.

use arrow::array::RecordBatch;
use weir_graph::batch::with_column;
use weir_graph::{Stage, StageError, StepContext};

use crate::data::columns::{float_list_array, float_lists, generated_masks};
use crate::rollout::col;

/// The summed student − teacher log-probs of generated tokens, and their count.
pub type LogProbGap = (f64, f64);

/// Writes (or adds to) `advantages` the distillation term of each token,
/// and the same as `returns`.
#[derive(Clone, Debug)]
pub struct DistillAdvantage {
    coef: f64,
    /// Each open step's sum of student − teacher log-probs and its token
    /// count (a later step's rows may come before an earlier one ends).
    kl: std::collections::BTreeMap<u64, LogProbGap>,
}

impl DistillAdvantage {
    /// The term scaled by `coef`.
    pub fn new(coef: f64) -> Self {
        DistillAdvantage {
            coef,
            kl: Default::default(),
        }
    }

    /// Each row's advantages: the term added to `task` (or alone), and
    /// the rows' summed log-prob gaps and token count.
    pub fn advantages(
        &self,
        student: &[Vec<f64>],
        teacher: &[Vec<f64>],
        generated: &[Vec<f64>],
        task: Option<&[Vec<f64>]>,
    ) -> Result<(Vec<Vec<f64>>, LogProbGap), String> {
        let mut kl = (0.0, 0.0);
        let rows = student
            .iter()
            .zip(teacher)
            .zip(generated)
            .enumerate()
            .map(|(i, ((s, t), g))| {
                let base = task.map(|a| &a[i]);
                if t.len() != s.len() || base.is_some_and(|b| b.len() != s.len()) {
                    return Err(format!(
                        "row {i}: {} behaviour log-probs, {} teacher log-probs{}",
                        s.len(),
                        t.len(),
                        base.map(|b| format!(", {} advantages", b.len()))
                            .unwrap_or_default()
                    ));
                }
                Ok((0..s.len())
                    .map(|j| {
                        let on = g.get(j).copied().unwrap_or(1.0);
                        let gap = t[j] - s[j];
                        kl.0 -= gap * on;
                        kl.1 += on;
                        base.map_or(0.0, |b| b[j]) + self.coef * gap * on
                    })
                    .collect())
            })
            .collect::<Result<Vec<Vec<f64>>, String>>()?;
        Ok((rows, kl))
    }
}

impl Stage for DistillAdvantage {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let stage = ctx.stage().to_string();
        let student = float_lists(&batch, col::BEHAVIOR_LOGPROBS, &stage)?;
        let teacher = float_lists(&batch, col::TEACHER_LOGPROBS, &stage)?;
        let lengths: Vec<usize> = student.iter().map(Vec::len).collect();
        let generated = generated_masks(&batch, &lengths, &stage)?;
        let task = match batch.schema().index_of(col::ADVANTAGES) {
            Ok(_) => Some(float_lists(&batch, col::ADVANTAGES, &stage)?),
            Err(_) => None,
        };
        let (rows, kl) = self
            .advantages(&student, &teacher, &generated, task.as_deref())
            .map_err(|e| format!("{stage}: {e}"))?;
        let step = self.kl.entry(ctx.step).or_default();
        *step = (step.0 + kl.0, step.1 + kl.1);
        // No value baseline: the return is the advantage, as the
        // outcome-only estimators write it.
        let batch = with_column(&batch, col::ADVANTAGES, float_list_array(&rows))?;
        Ok(vec![with_column(
            &batch,
            col::RETURNS,
            float_list_array(&rows),
        )?])
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        let (sum, tokens) = self.kl.remove(&ctx.step).unwrap_or_default();
        if tokens > 0.0 {
            ctx.record("teacher_kl", sum / tokens);
        }
        Ok(Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_term_is_the_teachers_log_prob_less_the_students() {
        let student = vec![vec![-1.0, -2.0, -0.5], vec![-3.0]];
        let teacher = vec![vec![-0.5, -2.5, -0.5], vec![-1.0]];
        // Row 0's middle token an observation: no term.
        let generated = vec![vec![1.0, 0.0, 1.0], vec![1.0]];
        let alone = DistillAdvantage::new(1.0);
        let (a, kl) = alone
            .advantages(&student, &teacher, &generated, None)
            .unwrap();
        assert_eq!(a, vec![vec![0.5, 0.0, 0.0], vec![2.0]]);
        // k1 of the reverse KL over the three generated tokens: (-0.5 + 0 - 2) / 3.
        assert_eq!(kl, (-2.5, 3.0));
        let task = vec![vec![1.0, 1.0, 1.0], vec![-1.0]];
        let mixed = DistillAdvantage::new(0.5);
        let (b, _) = mixed
            .advantages(&student, &teacher, &generated, Some(&task))
            .unwrap();
        assert_eq!(b, vec![vec![1.25, 1.0, 1.0], vec![0.0]]);
        let short = vec![vec![-1.0], vec![-1.0]];
        let err = alone
            .advantages(&student, &short, &generated, None)
            .unwrap_err();
        assert!(
            err.contains("row 0") && err.contains("1 teacher log-probs"),
            "{err}"
        );
    }
}
