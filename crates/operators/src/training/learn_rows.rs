//! A step's rows as the learner reads them ([`LearnRows`]: tokens,
//! advantages, behaviour and reference log-probs, rewards, the generated
//! mask, a teacher's top k) and how they are cut into mini- and
//! micro-batches: a row count, a padded-token budget over rows sorted by
//! width, or packed rows up to a token budget.

use arrow::array::RecordBatch;
use tch::Tensor;
use weir_graph::StageError;

use crate::algorithms::GkdLoss;
use crate::data::columns::{float_lists, token_lists};
use crate::rollout::col;

/// A step's rows as the learner reads them, in the order it trains them.
pub(crate) struct LearnRows {
    pub(crate) prompts: Vec<Vec<i64>>,
    pub(crate) responses: Vec<Vec<i64>>,
    pub(crate) advantages: Vec<Vec<f64>>,
    pub(crate) behaviour: Vec<Vec<f64>>,
    /// The reference's log-probs, when the KL to it is a loss term.
    pub(crate) references: Option<Vec<Vec<f64>>>,
    /// Each row's reward, when the rows carry one.
    pub(crate) rewards: Option<Vec<f64>>,
    /// 1.0 on each response token the model generated, 0.0 on an
    /// episode's observation and boundary tokens (`token_kinds`).
    pub(crate) generated: Vec<Vec<f64>>,
    /// The teacher's top-k tokens and log-probs, when a top-k loss term reads them.
    pub(crate) top: Option<TopK>,
}

/// Each row's teacher top-k ids and log-probs: `k` per response position,
/// position after position.
pub(crate) struct TopK {
    pub(crate) k: usize,
    pub(crate) ids: Vec<Vec<i64>>,
    pub(crate) logprobs: Vec<Vec<f64>>,
}

impl LearnRows {
    /// `batch`'s rows (none for a rank without rows; stage `stage`'s
    /// input), with the reference's log-probs if `references`, and the
    /// teacher's top-k tokens for a `gkd` term (each an id of the
    /// student's `vocab`).
    pub(crate) fn read(
        batch: Option<&RecordBatch>,
        references: bool,
        gkd: Option<GkdLoss>,
        vocab: i64,
        stage: &str,
    ) -> Result<Self, StageError> {
        let tokens = |name| batch.map_or(Ok(Vec::new()), |b| token_lists(b, name, stage));
        let floats = |name| batch.map_or(Ok(Vec::new()), |b| float_lists(b, name, stage));
        let rewards = batch
            .map(|b| crate::data::columns::f32s(b, col::REWARD, stage))
            .transpose()
            .or_else(|e| {
                // Rows without a reward (a pipeline that scores elsewhere) are fine; a mistyped one is not.
                match batch.and_then(|b| b.column_by_name(col::REWARD)) {
                    Some(_) => Err(e),
                    None => Ok(None),
                }
            })?;
        let responses = tokens(col::RESPONSE_TOKENS)?;
        let lengths: Vec<usize> = responses.iter().map(Vec::len).collect();
        let generated = batch.map_or(Ok(Vec::new()), |b| {
            crate::data::columns::generated_masks(b, &lengths, stage)
        })?;
        let top = match gkd {
            None => None,
            Some(g) => {
                let top = TopK {
                    k: g.k,
                    ids: tokens(col::TEACHER_TOPK_IDS)?,
                    logprobs: floats(col::TEACHER_TOPK_LOGPROBS)?,
                };
                for (i, len) in lengths.iter().enumerate() {
                    let want = len * g.k;
                    if top.ids[i].len() != want || top.logprobs[i].len() != want {
                        return Err(format!(
                            "{stage}: row {i}: {} teacher top-k ids and {} log-probs for {len} response tokens, and teacher.top_k = {} wants {want} of each",
                            top.ids[i].len(),
                            top.logprobs[i].len(),
                            g.k
                        )
                        .into());
                    }
                    if let Some(id) = top.ids[i].iter().find(|&&id| !(0..vocab).contains(&id)) {
                        return Err(format!(
                            "{stage}: row {i}: teacher top-k id {id} is outside the student's vocabulary (0..{vocab})"
                        )
                        .into());
                    }
                }
                Some(top)
            }
        };
        Ok(LearnRows {
            top,
            prompts: tokens(col::PROMPT_TOKENS)?,
            responses,
            advantages: floats(col::ADVANTAGES)?,
            behaviour: floats(col::BEHAVIOR_LOGPROBS)?,
            references: if references {
                Some(floats(col::REF_LOGPROBS)?)
            } else {
                None
            },
            rewards,
            generated,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.prompts.len()
    }

    /// The padded width of row `i` in a forward pass.
    pub(crate) fn width(&self, i: usize) -> usize {
        self.prompts[i].len() + self.responses[i].len().max(1)
    }

    /// Mini-batch `k` of `minis`: rows `[k·rows/M, (k+1)·rows/M)` of every
    /// rank (micro-batches lie within one).
    pub(crate) fn mini_batch(&self, k: usize, minis: usize) -> (usize, usize) {
        (k * self.len() / minis, (k + 1) * self.len() / minis)
    }

    /// The micro-batches of each of `minis` mini-batches: `micro` rows at a
    /// time, or under a token `budget` (> 0) rows sorted by width within
    /// their mini-batch (whose rows stay its own), so a micro-batch pads to
    /// neighbours of its length, and cut where the budget is reached.
    pub(crate) fn micro_batches(
        &mut self,
        minis: usize,
        micro: usize,
        budget: usize,
    ) -> Vec<Vec<(usize, usize)>> {
        let micro = micro.max(1);
        if budget > 0 {
            self.sort_by_width_within(minis);
        }
        (0..minis)
            .map(|k| {
                let (lo, hi) = self.mini_batch(k, minis);
                if budget == 0 {
                    return (lo..hi)
                        .step_by(micro)
                        .map(|start| (start, (start + micro).min(hi)))
                        .collect();
                }
                let widths: Vec<usize> = (lo..hi).map(|i| self.width(i)).collect();
                budget_cuts(&widths, micro, budget)
                    .into_iter()
                    .map(|(a, b)| (lo + a, lo + b))
                    .collect()
            })
            .collect()
    }

    /// The micro-batches of each of `minis` mini-batches when rows run
    /// packed end to end: at most `micro` rows, and with a token `budget`
    /// (> 0) rows in order up to that many tokens in all (no row is split:
    /// one longer than the budget is an error naming the key).
    pub(crate) fn packed_micro_batches(
        &self,
        minis: usize,
        micro: usize,
        budget: usize,
    ) -> Result<Vec<Vec<(usize, usize)>>, StageError> {
        let micro = micro.max(1);
        if budget > 0 {
            if let Some(i) = (0..self.len()).find(|&i| self.width(i) > budget) {
                return Err(format!(
                    "algorithm.micro_batch_tokens = {budget}: a row of {} tokens (prompt and response) does not fit, and packed rows are not split",
                    self.width(i)
                )
                .into());
            }
        }
        Ok((0..minis)
            .map(|k| {
                let (lo, hi) = self.mini_batch(k, minis);
                let mut cuts = Vec::new();
                let (mut start, mut tokens) = (lo, 0);
                for i in lo..hi {
                    let full =
                        i - start == micro || (budget > 0 && tokens + self.width(i) > budget);
                    if full && i > start {
                        cuts.push((start, i));
                        (start, tokens) = (i, 0);
                    }
                    tokens += self.width(i);
                }
                if hi > start {
                    cuts.push((start, hi));
                }
                cuts
            })
            .collect())
    }

    /// Sorts the rows of each of `minis` mini-batches by width.
    pub(crate) fn sort_by_width_within(&mut self, minis: usize) {
        let mut order: Vec<usize> = Vec::with_capacity(self.len());
        for k in 0..minis {
            let (lo, hi) = self.mini_batch(k, minis);
            let start = order.len();
            order.extend(lo..hi);
            order[start..].sort_by_key(|&i| self.width(i));
        }
        permute(&mut self.prompts, &order);
        permute(&mut self.responses, &order);
        permute(&mut self.advantages, &order);
        permute(&mut self.behaviour, &order);
        permute(&mut self.generated, &order);
        if let Some(refs) = self.references.as_mut() {
            permute(refs, &order);
        }
        if let Some(top) = self.top.as_mut() {
            permute(&mut top.ids, &order);
            permute(&mut top.logprobs, &order);
        }
    }
}

/// Micro-batches `[start, end)` over rows of ascending `widths`: each at
/// most `micro` rows whose padded size (rows × the widest) is at most
/// `budget` tokens; a row wider than the budget goes alone.
pub(crate) fn budget_cuts(widths: &[usize], micro: usize, budget: usize) -> Vec<(usize, usize)> {
    let mut cuts = Vec::new();
    let mut start = 0;
    for end in 1..=widths.len() {
        // Ascending, so the row just taken is the micro-batch's widest.
        let over = (end - start) * widths[end - 1] > budget || end - start > micro;
        if over && end - 1 > start {
            cuts.push((start, end - 1));
            start = end - 1;
        }
    }
    if widths.len() > start {
        cuts.push((start, widths.len()));
    }
    cuts
}

/// Reorders `values` so that entry `i` is the old entry `order[i]`.
fn permute<T>(values: &mut Vec<T>, order: &[usize]) {
    let mut old: Vec<Option<T>> = values.drain(..).map(Some).collect();
    values.extend(order.iter().map(|&i| {
        old[i]
            .take()
            .expect("a permutation names each row once: it is 0..rows sorted")
    }));
}

pub(crate) fn padded(rows: &[Vec<f64>], width: usize, device: tch::Device) -> Tensor {
    let mut flat = Vec::with_capacity(rows.len() * width);
    for r in rows {
        flat.extend(
            r.iter()
                .map(|x| *x as f32)
                .chain(std::iter::repeat_n(0.0, width - r.len().min(width))),
        );
    }
    Tensor::from_slice(&flat)
        .view([rows.len() as i64, width as i64])
        .to_device(device)
}

/// Rows of ids, `k` per position, as `[rows, width, k]` (0 past each row's end).
pub(crate) fn top_grid(rows: &[Vec<i64>], width: usize, k: usize, device: tch::Device) -> Tensor {
    let mut flat = Vec::with_capacity(rows.len() * width * k);
    for r in rows {
        let n = r.len().min(width * k);
        flat.extend_from_slice(&r[..n]);
        flat.extend(std::iter::repeat_n(0, width * k - n));
    }
    Tensor::from_slice(&flat)
        .view([rows.len() as i64, width as i64, k as i64])
        .to_device(device)
}
