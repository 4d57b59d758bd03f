//! `PromptSource`: B prompts × n samples per step, the prompt order shuffled
//! per epoch with a seed, and a cursor a checkpoint can restore.

use std::sync::Arc;

use arrow::array::{ArrayRef, BooleanArray, RecordBatch, StringArray, UInt32Array, UInt64Array};
use arrow::datatypes::{DataType, Field};
use weir_graph::{Source, SourceContext, StageError};

use weir_gpu::Tokenizer;

use crate::data::columns::token_list_array;
use crate::data::cursor::{Cursor, CursorLog};
use crate::data::prompt_files::{self, PromptColumn, PromptFormat, PromptLimit, PromptRow};
use crate::error::OperatorError;
use crate::rollout::{col, schema_after, Phase};

/// Turns a drawn prompt into its token ids, for prompt sets that are cheap
/// to list and costly to tokenize all at once (the arith task's 9,500 chat
/// prompts): see [`PromptSource::tokenized_when_drawn`].
#[derive(Clone)]
pub struct Tokenize(pub Arc<TokenizeFn>);

/// What [`Tokenize`] calls: a prompt row's token ids.
pub type TokenizeFn = dyn Fn(&PromptRow) -> Result<Vec<i64>, StageError> + Send + Sync;

impl std::fmt::Debug for Tokenize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokenize(…)")
    }
}

/// Emits prompts_per_step prompts × samples per step.
#[derive(Clone, Debug)]
pub struct PromptSource {
    rows: Arc<Vec<PromptRow>>,
    /// How a drawn row gets its tokens, when its `tokens` are not set ahead.
    tokenize: Option<Tokenize>,
    extra_columns: Vec<String>,
    prompts_per_step: usize,
    samples: usize,
    seed: u64,
    epochs: Option<u64>,
    cursor: Cursor,
    order: Vec<usize>,
    rank: usize,
    role_size: usize,
    curriculum: Option<super::prompt_stats::Curriculum>,
    cursor_log: Option<CursorLog>,
    greedy_baseline: bool,
    /// Whether the rows carry their conversations (`prompt_messages`).
    with_messages: bool,
    /// The last step the run needs prompts for ([`PromptSource::required_through`]).
    required_through: Option<u64>,
}

fn shuffled(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut state = seed ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

impl PromptSource {
    /// A source over `rows` (with `extra_columns` named), `prompts_per_step` × `samples` rows a step.
    pub fn new(
        rows: Vec<PromptRow>,
        extra_columns: Vec<String>,
        prompts_per_step: usize,
        samples: usize,
        seed: u64,
    ) -> Result<Self, StageError> {
        if rows.is_empty() {
            return Err("the prompt set is empty".into());
        }
        if prompts_per_step == 0 || samples == 0 {
            return Err("prompts per step and samples per prompt must be at least 1".into());
        }
        if let Some((i, r)) = rows
            .iter()
            .enumerate()
            .find(|(_, r)| r.extra.len() != extra_columns.len())
        {
            return Err(format!(
                "prompt {i} has {} extra values for {} columns",
                r.extra.len(),
                extra_columns.len()
            )
            .into());
        }
        let order = shuffled(rows.len(), seed, 0);
        let with_messages = rows.iter().any(|r| r.messages.is_some());
        Ok(PromptSource {
            with_messages,
            rows: Arc::new(rows),
            tokenize: None,
            extra_columns,
            prompts_per_step,
            samples,
            seed,
            epochs: None,
            cursor: Cursor::default(),
            order,
            rank: 0,
            role_size: 1,
            curriculum: None,
            cursor_log: None,
            greedy_baseline: false,
            required_through: None,
        })
    }

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
        let rows = prompt_files::read(path, prompt, format, extra, limit, tokenizer)?;
        PromptSource::new(rows, extra.to_vec(), prompts_per_step, samples, seed)
            .map_err(|e| OperatorError::file(path, e).into())
    }

    /// The same prompt set with `samples` rows per prompt (at least 1); the
    /// rows are shared, not read or tokenised again.
    pub fn with_samples(mut self, samples: usize) -> Self {
        self.samples = samples.max(1);
        self
    }

    /// Every prompt of the set in each step (an evaluation's one step).
    pub fn every_prompt_per_step(mut self) -> Self {
        self.prompts_per_step = self.rows.len();
        self
    }

    /// ReMax: one more row per prompt, marked `greedy_baseline` (a bool
    /// column on every row), for the generator to answer greedily.
    pub fn greedy_baseline(mut self) -> Self {
        self.greedy_baseline = true;
        self
    }

    /// Stops after `epochs` passes over the prompts (default: never).
    pub fn epochs(mut self, epochs: u64) -> Self {
        self.epochs = Some(epochs);
        self
    }

    /// The steps the epochs still allow from the cursor (`None`: no limit,
    /// or a curriculum, whose skips make it unknown).
    pub fn steps_left(&self) -> Option<u64> {
        let epochs = self.epochs?;
        if self.curriculum.is_some() {
            return None;
        }
        let n = self.rows.len() as u64;
        let drawn = self.cursor.epoch * n + self.cursor.position as u64;
        Some((epochs * n).saturating_sub(drawn) / self.prompts_per_step as u64)
    }

    /// The run needs prompts through step `last`: running out before it is
    /// an error naming the settings, not a quiet early end.
    pub fn required_through(mut self, last: u64) -> Self {
        self.required_through = Some(last);
        self
    }

    /// Why the prompts cannot reach step `last` when they end before `step`.
    pub fn shortfall(&self, step: u64, last: u64) -> String {
        format!(
            "the prompts run out at step {step}, before the run's last step {last}: \
             data.epochs = {} pass(es) over {} prompts at {} a step (data.prompts_per_step); \
             raise data.epochs (0: as many as the steps need) or lower run.steps",
            self.epochs.unwrap_or(0),
            self.rows.len(),
            self.prompts_per_step
        )
    }

    /// This instance's share when the source role has `size` workers.
    pub fn shard(mut self, rank: usize, size: usize) -> Self {
        self.rank = rank;
        self.role_size = size.max(1);
        self
    }

    /// Skips the prompts `curriculum` rules out (mastered or hopeless so far).
    /// When every prompt is ruled out, prompts are taken anyway rather than
    /// searching forever.
    pub fn curriculum(mut self, curriculum: super::prompt_stats::Curriculum) -> Self {
        self.curriculum = Some(curriculum);
        self
    }

    /// Records the cursor after every step into `log` (for checkpoints).
    pub fn cursor_log(mut self, log: CursorLog) -> Self {
        self.cursor_log = Some(log);
        self
    }

    /// Tokenizes each prompt with `tokenize` when a step draws it, instead
    /// of reading its row's `tokens` (left empty): a run that draws a few
    /// hundred of a set's prompts tokenizes those only.
    pub fn tokenized_when_drawn(mut self, tokenize: Tokenize) -> Self {
        self.tokenize = Some(tokenize);
        self
    }

    /// The prompt set (without tokens, for a set tokenized when drawn).
    pub fn rows(&self) -> &[PromptRow] {
        &self.rows
    }

    /// Where the source is now.
    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// Continues from a saved cursor, refused (saying why) when this prompt
    /// set could not have reached it: a position past its prompts, an epoch
    /// past `data.epochs`, or more prompts drawn than fit in 63 bits (a
    /// crafted `state.json`).
    pub fn restore(&mut self, cursor: Cursor) -> Result<(), String> {
        let len = self.rows.len() as u64;
        let drawn = cursor
            .epoch
            .checked_mul(len.max(1))
            .and_then(|d| d.checked_add(cursor.position as u64))
            .filter(|d| *d < 1 << 63);
        let why = if cursor.position as u64 > len {
            Some(format!(
                "position {} is past the prompt set's {len} prompts",
                cursor.position
            ))
        } else if self.epochs.is_some_and(|e| cursor.epoch > e) {
            Some(format!("epoch {} is past data.epochs", cursor.epoch))
        } else if drawn.is_none() {
            Some(format!("epoch {} cannot be reached", cursor.epoch))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(format!(
                "the checkpoint's cursor (state.json): {why}: resume with the prompt set and \
                 data.epochs it was written with"
            ));
        }
        self.cursor = cursor;
        self.order = shuffled(self.rows.len(), self.seed, cursor.epoch);
        Ok(())
    }

    /// Step `step`'s prompt indices, advancing the cursor (None when the epochs are done).
    fn take_prompts(&mut self, step: u64) -> Option<Vec<usize>> {
        let mut out = Vec::with_capacity(self.prompts_per_step);
        // Skipped in a row; after a whole dataset's worth, the curriculum is ignored.
        let mut skipped = 0;
        while out.len() < self.prompts_per_step {
            if self.epochs.is_some_and(|e| self.cursor.epoch >= e) {
                return None;
            }
            if self.cursor.position == self.order.len() {
                self.cursor = Cursor {
                    epoch: self.cursor.epoch + 1,
                    position: 0,
                };
                self.order = shuffled(self.rows.len(), self.seed, self.cursor.epoch);
                continue;
            }
            let prompt = self.order[self.cursor.position];
            self.cursor.position += 1;
            if skipped < self.rows.len()
                && self
                    .curriculum
                    .as_ref()
                    .is_some_and(|c| c.skips(prompt as u64, step))
            {
                skipped += 1;
                continue;
            }
            out.push(prompt);
        }
        Some(out)
    }
}

impl Source for PromptSource {
    fn next_step(&mut self, ctx: &SourceContext) -> Result<Option<Vec<RecordBatch>>, StageError> {
        // Every worker of the role advances the same cursor and keeps its share.
        let Some(prompts) = self.take_prompts(ctx.step) else {
            return match self.required_through {
                Some(last) if ctx.step <= last => Err(self.shortfall(ctx.step, last).into()),
                _ => Ok(None),
            };
        };
        if let Some(log) = &self.cursor_log {
            log.record(ctx.step, self.cursor);
        }
        let mut step = Vec::new();
        let (mut prompt_id, mut group_id, mut sample_idx, mut text, mut tokens) =
            (vec![], vec![], vec![], vec![], vec![]);
        let mut messages = Vec::new();
        let mut extra: Vec<Vec<String>> = vec![Vec::new(); self.extra_columns.len()];
        let mut greedy = Vec::new();
        for (i, &p) in prompts.iter().enumerate() {
            if i % self.role_size != self.rank {
                continue;
            }
            let row = &self.rows[p];
            let row_tokens = match &self.tokenize {
                Some(tokenize) => (tokenize.0)(row)?,
                None => row.tokens.clone(),
            };
            let rows = self.samples + usize::from(self.greedy_baseline);
            for s in 0..rows {
                greedy.push(s == self.samples);
                step.push(ctx.step);
                prompt_id.push(p as u64);
                group_id.push(ctx.step * self.prompts_per_step as u64 + i as u64);
                sample_idx.push(s as u32);
                text.push(row.prompt.clone());
                messages.push(row.messages.clone());
                tokens.push(row_tokens.clone());
                for (c, v) in extra.iter_mut().zip(&row.extra) {
                    c.push(v.clone());
                }
            }
        }
        let mut dataset: Vec<Field> = self
            .extra_columns
            .iter()
            .map(|n| Field::new(n, DataType::Utf8, false))
            .collect();
        if self.greedy_baseline {
            dataset.push(Field::new(col::GREEDY_BASELINE, DataType::Boolean, false));
        }
        let mut schema = schema_after(Phase::Prompt, &dataset);
        let mut columns: Vec<ArrayRef> = vec![
            Arc::new(UInt64Array::from(step)),
            Arc::new(UInt64Array::from(prompt_id)),
            Arc::new(UInt64Array::from(group_id)),
            Arc::new(UInt32Array::from(sample_idx)),
            Arc::new(StringArray::from(text)),
        ];
        if self.with_messages {
            columns.push(Arc::new(StringArray::from(messages)));
        } else {
            // The optional conversations column is left out.
            let kept: Vec<usize> = (0..schema.fields().len())
                .filter(|&i| schema.field(i).name() != col::PROMPT_MESSAGES)
                .collect();
            schema = Arc::new(schema.project(&kept)?);
        }
        columns.push(token_list_array(&tokens));
        columns.extend(
            extra
                .into_iter()
                .map(|c| Arc::new(StringArray::from(c)) as ArrayRef),
        );
        if self.greedy_baseline {
            columns.push(Arc::new(BooleanArray::from(greedy)));
        }
        debug_assert_eq!(schema.fields().len(), columns.len());
        Ok(Some(vec![RecordBatch::try_new(schema, columns)?]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::col;
    use weir_graph::WorkerInfo;

    fn rows(n: usize) -> Vec<PromptRow> {
        (0..n)
            .map(|i| PromptRow {
                prompt: format!("p{i}"),
                messages: None,
                tokens: vec![i as i64 + 4],
                extra: vec![i.to_string()],
            })
            .collect()
    }

    fn ctx(step: u64) -> SourceContext {
        SourceContext {
            step,
            worker: WorkerInfo::single(),
        }
    }

    #[test]
    fn every_prompt_once_per_epoch_then_reshuffled_and_restorable() {
        let mut src = PromptSource::new(rows(6), vec!["answer".into()], 3, 2, 42)
            .unwrap()
            .epochs(2);
        let mut seen = Vec::new();
        for step in 0..4 {
            let batch = src.next_step(&ctx(step)).unwrap().unwrap().remove(0);
            assert_eq!(batch.num_rows(), 6, "3 prompts × 2 samples");
            crate::rollout::check(&batch, Phase::Prompt, "source").unwrap();
            let ids = crate::data::columns::u64s(&batch, col::PROMPT_ID, "t").unwrap();
            let groups = crate::data::columns::u64s(&batch, col::GROUP_ID, "t").unwrap();
            assert_eq!(
                groups,
                vec![
                    step * 3,
                    step * 3,
                    step * 3 + 1,
                    step * 3 + 1,
                    step * 3 + 2,
                    step * 3 + 2
                ]
            );
            seen.extend(ids.iter().step_by(2).copied());
        }
        let (first, second) = seen.split_at(6);
        let mut a = first.to_vec();
        a.sort();
        assert_eq!(a, vec![0, 1, 2, 3, 4, 5]);
        assert_ne!(first, second, "a new epoch reshuffles");
        assert!(
            src.next_step(&ctx(4)).unwrap().is_none(),
            "two epochs, then done"
        );
        // Restoring a cursor replays the same prompts.
        let mut a = PromptSource::new(rows(6), vec!["answer".into()], 3, 1, 42).unwrap();
        a.next_step(&ctx(0)).unwrap();
        let saved = a.cursor();
        let next = a.next_step(&ctx(1)).unwrap().unwrap().remove(0);
        let mut b = PromptSource::new(rows(6), vec!["answer".into()], 3, 1, 42).unwrap();
        b.restore(saved).unwrap();
        assert_eq!(b.next_step(&ctx(1)).unwrap().unwrap().remove(0), next);
    }

    /// The steps epochs allow are known up front (7 prompts, 3 a step, 2
    /// epochs: 14 prompts, 4 whole steps), and a source the run needs for
    /// longer fails at the step it runs out, naming the settings.
    #[test]
    fn epochs_count_their_steps_and_running_out_early_is_an_error() {
        let src = PromptSource::new(rows(7), vec!["answer".into()], 3, 1, 1)
            .unwrap()
            .epochs(2);
        assert_eq!(src.steps_left(), Some(4));
        let unlimited = PromptSource::new(rows(7), vec!["answer".into()], 3, 1, 1).unwrap();
        assert_eq!(unlimited.steps_left(), None);
        let mut src = src.required_through(5);
        for step in 0..4 {
            assert!(src.next_step(&ctx(step)).unwrap().is_some());
        }
        assert_eq!(src.steps_left(), Some(0));
        let err = src.next_step(&ctx(4)).unwrap_err().to_string();
        assert!(
            err.contains("step 4") && err.contains("data.epochs = 2") && err.contains("run.steps"),
            "{err}"
        );
        // A source that ends with the run's last step ends quietly after it.
        let mut src = PromptSource::new(rows(7), vec!["answer".into()], 3, 1, 1)
            .unwrap()
            .epochs(2)
            .required_through(3);
        for step in 0..4 {
            assert!(src.next_step(&ctx(step)).unwrap().is_some());
        }
        assert!(src.next_step(&ctx(4)).unwrap().is_none());
    }

    #[test]
    fn a_curriculum_skips_settled_mastered_prompts() {
        use super::super::prompt_stats::{Curriculum, PromptStats, StatsView};
        use weir_graph::{StepContext, StepStage};
        let view = StatsView::new();
        let mut stats = PromptStats::new(view.clone(), 1.0);
        // Step 0 solved prompts 0 and 1 every time, prompt 2 half the time.
        let scored = RecordBatch::try_from_iter([
            (
                col::PROMPT_ID,
                Arc::new(UInt64Array::from(vec![0, 0, 1, 1, 2, 2])) as ArrayRef,
            ),
            (
                col::REWARD,
                Arc::new(arrow::array::Float32Array::from(vec![
                    1.0, 1.0, 1.0, 1.0, 1.0, 0.0,
                ])) as ArrayRef,
            ),
        ])
        .unwrap();
        let mut sctx = StepContext::detached(0, ctx(0).worker, 0);
        stats.run_step(&mut sctx, Some(scored)).unwrap();
        let curriculum = Curriculum {
            view,
            min_samples: 2,
            max_solve_rate: 1.0,
            min_solve_rate: -1.0,
            max_staleness: 0,
        };
        let mut src = PromptSource::new(rows(4), vec!["answer".into()], 2, 1, 3)
            .unwrap()
            .curriculum(curriculum);
        let mut drawn = Vec::new();
        for step in 1..5 {
            let batch = src.next_step(&ctx(step)).unwrap().unwrap().remove(0);
            drawn.extend(crate::data::columns::u64s(&batch, col::PROMPT_ID, "t").unwrap());
        }
        assert!(!drawn.contains(&0) && !drawn.contains(&1), "{drawn:?}");
        assert_eq!(drawn.len(), 8, "mastered prompts do not shrink the step");
    }

    #[test]
    fn derived_cursors_match_the_drawn_ones() {
        // 7 prompts, 3 per step: epochs turn mid-step and (at 21) exactly at a step's end.
        for (start_step, per_step) in [(0u64, 3usize), (2, 3), (0, 7), (1, 1)] {
            let mut src =
                PromptSource::new(rows(7), vec!["answer".into()], per_step, 1, 5).unwrap();
            for step in 0..start_step {
                src.next_step(&ctx(step)).unwrap();
            }
            let derived = CursorLog::derived(start_step, src.cursor(), per_step, 7);
            for step in start_step..start_step + 12 {
                src.next_step(&ctx(step)).unwrap();
                assert_eq!(
                    derived.after(step),
                    Some(src.cursor()),
                    "step {step}, {per_step} per step"
                );
            }
            if start_step >= 2 {
                assert_eq!(derived.after(start_step - 2), None, "before the segment");
            }
        }
        assert_eq!(CursorLog::new().after(3), None);
    }

    #[test]
    fn shards_split_the_prompts_of_a_step() {
        let mut a = PromptSource::new(rows(8), vec!["answer".into()], 4, 1, 1)
            .unwrap()
            .shard(0, 2);
        let mut b = PromptSource::new(rows(8), vec!["answer".into()], 4, 1, 1)
            .unwrap()
            .shard(1, 2);
        let ra = a.next_step(&ctx(0)).unwrap().unwrap().remove(0);
        let rb = b.next_step(&ctx(0)).unwrap().unwrap().remove(0);
        assert_eq!(ra.num_rows() + rb.num_rows(), 4);
        let ga = crate::data::columns::u64s(&ra, col::GROUP_ID, "t").unwrap();
        let gb = crate::data::columns::u64s(&rb, col::GROUP_ID, "t").unwrap();
        assert!(ga.iter().all(|g| !gb.contains(g)));
        assert!(PromptSource::new(vec![], vec![], 1, 1, 0).is_err());
    }
}
