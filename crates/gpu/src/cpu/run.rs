//! Calls on the CPU kernels: generation and no-grad response log-probs.
//!
//! Each sequence has its own cache slot and no padding. Each distinct prompt
//! is prefilled once and its keys and values are copied to the slots of the
//! other rows that share it (a group's samples, or a batch that repeats
//! prompts itself, as the RL prompt source sends them).

use std::collections::HashMap;
use std::sync::Arc;

use super::engine::CpuModel;
use super::pack::packed;
use super::sample::Picker;
use super::state::{Cache, RopeTables, Row, Scratch};
use crate::error::ModelError;
use crate::model::Model;
use crate::sampling::{Generation, Pick, SamplingParams, Stream};
use crate::slots::Slots;

/// Prompt tokens run through the model at once during prefill.
const PREFILL_ROWS: usize = 256;

/// One call's state: the packed model, RoPE tables, cache, activations and
/// thread pool. It borrows nothing from the model, so a streaming generator
/// keeps one across calls while new weights are applied to the model.
pub(crate) struct Run {
    pub(super) cpu: Arc<CpuModel>,
    rope: RopeTables,
    pub(super) cache: Cache,
    scratch: Scratch,
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl Run {
    /// `slots` sequences of up to `capacity` positions on `model`.
    pub(super) fn start(model: &Model, slots: usize, capacity: usize) -> Result<Self, ModelError> {
        let prepared = model.prepared_for_cpu();
        let cpu = packed(model)?;
        let cache = Cache::new(prepared.take_cache(), slots, cpu.shape(), capacity);
        Ok(Run {
            rope: rope_tables(model, capacity)?,
            cache,
            scratch: Scratch::default(),
            pool: prepared.pool()?,
            cpu,
        })
    }

    /// Packs `model`'s current weights (after new ones were applied).
    pub(super) fn repack(&mut self, model: &Model) -> Result<(), ModelError> {
        self.cpu = packed(model)?;
        Ok(())
    }

    /// Makes room for `capacity` positions per slot, keeping the first
    /// `len` positions of each `(slot, len)` of `keep`.
    pub(super) fn grow(
        &mut self,
        model: &Model,
        capacity: usize,
        keep: &[(usize, usize)],
    ) -> Result<(), ModelError> {
        if capacity <= self.cache.capacity {
            return Ok(());
        }
        let slots = self.cache.slots();
        let mut cache = Cache::new(Vec::new(), slots, self.cpu.shape(), capacity);
        for &(slot, len) in keep {
            self.cache.copy_slot_into(slot, len, &mut cache);
        }
        self.cache = cache;
        self.rope = rope_tables(model, capacity)?;
        Ok(())
    }

    /// [`CpuModel::forward`] on this call's state.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    pub(super) unsafe fn forward(
        &mut self,
        ids: &[i64],
        rows: &[Row],
        logit_rows: &[usize],
    ) -> &[f32] {
        self.cpu.forward(
            ids,
            rows,
            &mut self.cache,
            &self.rope,
            &mut self.scratch,
            logit_rows,
            self.pool.as_deref(),
        )
    }

    /// Runs each `(slot, context)` of `items` into its slot from position 0:
    /// each distinct context once, into the slot of its first item, whose
    /// keys and values are then copied to the slots of the items equal to
    /// it. Returns the logits after each item's last token, `[items, vocab]`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    pub(super) unsafe fn prefill(&mut self, items: &[(usize, &[i64])]) -> Vec<f32> {
        let vocab = self.cpu.shape.vocab;
        let contexts: Vec<&[i64]> = items.iter().map(|&(_, c)| c).collect();
        let owner = owners(&contexts);
        let mut first = vec![0.0f32; items.len() * vocab];
        let tokens: Vec<(usize, usize, i64)> = contexts
            .iter()
            .enumerate()
            .filter(|&(i, _)| owner[i] == i)
            .flat_map(|(i, context)| {
                context
                    .iter()
                    .enumerate()
                    .map(move |(pos, &id)| (i, pos, id))
            })
            .collect();
        for chunk in tokens.chunks(PREFILL_ROWS) {
            let ids: Vec<i64> = chunk.iter().map(|t| t.2).collect();
            let rows: Vec<Row> = chunk
                .iter()
                .map(|&(i, pos, _)| Row {
                    slot: items[i].0,
                    pos,
                })
                .collect();
            let last: Vec<usize> = (0..chunk.len())
                .filter(|&j| chunk[j].1 + 1 == contexts[chunk[j].0].len())
                .collect();
            let logits = self.forward(&ids, &rows, &last);
            for (j, &t) in last.iter().enumerate() {
                let i = chunk[t].0;
                first[i * vocab..(i + 1) * vocab]
                    .copy_from_slice(&logits[j * vocab..(j + 1) * vocab]);
            }
        }
        for (i, &(slot, context)) in items.iter().enumerate() {
            let o = owner[i];
            if o != i {
                self.cache.copy_prefix(items[o].0, slot, context.len());
                first.copy_within(o * vocab..(o + 1) * vocab, i * vocab);
            }
        }
        first
    }

    /// Hands the cache buffer back to `model` for its next call.
    pub(super) fn finish(self, model: &Model) {
        model.prepared_for_cpu().give_back_cache(self.cache.data);
    }
}

/// `model`'s RoPE tables for positions `0..len`.
fn rope_tables(model: &Model, len: usize) -> Result<RopeTables, ModelError> {
    RopeTables::new(model.rope(), model.config.head_dim as usize, len)
}

/// For each context, the index of the first context equal to it.
fn owners(contexts: &[&[i64]]) -> Vec<usize> {
    let mut seen: HashMap<&[i64], usize> = HashMap::new();
    contexts
        .iter()
        .enumerate()
        .map(|(i, context)| *seen.entry(context).or_insert(i))
        .collect()
}

/// Every row's `(slot, prompt)`: row `r` is sample `r % n` of prompt `r / n`.
fn row_items(prompts: &[Vec<i64>], n: usize) -> Vec<(usize, &[i64])> {
    (0..prompts.len() * n)
        .map(|r| (r, prompts[r / n].as_slice()))
        .collect()
}

/// [`crate::generate_with_ids`] on the CPU kernels. The caller has checked
/// the parameters (`max_new_tokens` ≥ 1), the prompts (non-empty, ids in
/// the vocabulary) and that the CPU runs the kernels.
pub fn generate(
    model: &Model,
    prompts: &[Vec<i64>],
    stream_ids: &[u64],
    params: &SamplingParams,
) -> Result<Vec<Generation>, ModelError> {
    let n = params.n;
    let mut out = Generation::empty_rows(prompts.len(), n);
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut run = Run::start(model, out.len(), longest + params.max_new_tokens)?;
    let vocab = run.cpu.shape.vocab;
    // SAFETY (all calls below): the caller checked that the CPU has AVX2 and FMA.
    let first = unsafe { run.prefill(&row_items(prompts, n)) };
    let mut streams: Vec<Stream> = (0..out.len())
        .map(|r| Stream::new(params.seed, stream_ids[r / n], (r % n) as u64))
        .collect();
    let mut picker = Picker::default();
    let mut row_logits = Vec::with_capacity(vocab);
    // Live sequences: (output row = cache slot, last token, its position).
    let mut live: Vec<(usize, i64, usize)> = Vec::with_capacity(out.len());
    for (r, generation) in out.iter_mut().enumerate() {
        let p = r / n;
        row_logits.clear();
        row_logits.extend_from_slice(&first[r * vocab..(r + 1) * vocab]);
        let pick = unsafe { picker.pick(&mut row_logits, params, streams[r].next_f32()) };
        if generation.record(pick, params) {
            live.push((r, pick.token, prompts[p].len()));
        }
    }
    let (mut ids, mut rows, mut all) = (Vec::new(), Vec::new(), Vec::new());
    while !live.is_empty() {
        ids.clear();
        rows.clear();
        for &(slot, token, pos) in &live {
            ids.push(token);
            rows.push(Row { slot, pos });
        }
        all.clear();
        all.extend(0..live.len());
        let logits = unsafe { run.forward(&ids, &rows, &all) };
        let mut kept = 0;
        for i in 0..live.len() {
            let (r, _, pos) = live[i];
            row_logits.clear();
            row_logits.extend_from_slice(&logits[i * vocab..(i + 1) * vocab]);
            let pick = unsafe { picker.pick(&mut row_logits, params, streams[r].next_f32()) };
            if out[r].record(pick, params) {
                live[kept] = (r, pick.token, pos + 1);
                kept += 1;
            }
        }
        live.truncate(kept);
    }
    run.finish(model);
    Ok(out)
}

/// Rows per forward call when every row needs its logits: at most 16M
/// logits (64 MiB) at once, between 16 and [`PREFILL_ROWS`] rows.
fn logit_chunk(vocab: usize) -> usize {
    ((16 << 20) / vocab.max(1)).clamp(16, PREFILL_ROWS)
}

/// `log p(responses[r][j] | prompts[r] ++ responses[r][..j])` at
/// `temperature`, for every row and response token, without gradients.
/// Equal prompts are run once. The caller has checked the rows (as many
/// responses as prompts, prompts non-empty, ids in the vocabulary) and that
/// the kernels apply.
pub fn response_logprobs(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    temperature: f64,
) -> Result<Vec<Vec<f32>>, ModelError> {
    let capacity = prompts
        .iter()
        .zip(responses)
        .map(|(p, r)| p.len() + r.len())
        .max()
        .unwrap_or(1);
    let mut run = Run::start(model, prompts.len(), capacity)?;
    let vocab = run.cpu.shape.vocab;
    let temperature = temperature as f32;
    let (mut picker, mut row) = (Picker::default(), Vec::with_capacity(vocab));
    let mut logprob = |logits: &[f32], target: i64| {
        row.clear();
        row.extend(logits.iter().map(|&x| x / temperature));
        // SAFETY: the caller checked that the CPU has AVX2 and FMA.
        unsafe { picker.log_prob(&row, target as usize) }
    };
    // SAFETY (both calls): as above.
    let first = unsafe { run.prefill(&row_items(prompts, 1)) };
    let mut out: Vec<Vec<f32>> = responses
        .iter()
        .enumerate()
        .map(|(r, response)| {
            let mut lp = Vec::with_capacity(response.len());
            if let Some(&target) = response.first() {
                lp.push(logprob(&first[r * vocab..(r + 1) * vocab], target));
            }
            lp
        })
        .collect();
    // Every response token but the last, in (row, position) order, so each
    // sees the keys of the ones before it.
    let tokens: Vec<(usize, usize)> = responses
        .iter()
        .enumerate()
        .flat_map(|(r, response)| (0..response.len().saturating_sub(1)).map(move |j| (r, j)))
        .collect();
    for chunk in tokens.chunks(logit_chunk(vocab)) {
        let ids: Vec<i64> = chunk.iter().map(|&(r, j)| responses[r][j]).collect();
        let rows: Vec<Row> = chunk
            .iter()
            .map(|&(r, j)| Row {
                slot: r,
                pos: prompts[r].len() + j,
            })
            .collect();
        let all: Vec<usize> = (0..chunk.len()).collect();
        let logits = unsafe { run.forward(&ids, &rows, &all) };
        for (i, &(r, j)) in chunk.iter().enumerate() {
            let lp = logprob(&logits[i * vocab..(i + 1) * vocab], responses[r][j + 1]);
            out[r].push(lp);
        }
    }
    run.finish(model);
    Ok(out)
}

/// The CPU kernels as a [`Slots`] backend (a [`crate::stream::Streamer`]'s): one cache
/// slot per sequence, the run kept across calls.
pub(crate) struct CpuSlots {
    slots: usize,
    run: Option<Run>,
    repack: bool,
    logits: Vec<f32>,
    picker: Picker,
}

impl CpuSlots {
    /// Room for `slots` sequences; made only where the kernels apply.
    pub(crate) fn new(slots: usize) -> Self {
        CpuSlots {
            slots,
            run: None,
            repack: false,
            logits: Vec::new(),
            picker: Picker::default(),
        }
    }
}

impl Slots for CpuSlots {
    fn reserve(
        &mut self,
        model: &Model,
        positions: usize,
        live: &[(usize, usize)],
    ) -> Result<(), ModelError> {
        match self.run.as_mut() {
            None => {
                self.run = Some(Run::start(model, self.slots, positions)?);
                self.repack = false;
            }
            Some(run) => {
                if self.repack {
                    run.repack(model)?;
                    self.repack = false;
                }
                let grown = positions.max(run.cache.capacity + run.cache.capacity / 2);
                if positions > run.cache.capacity {
                    run.grow(model, grown, live)?;
                }
            }
        }
        Ok(())
    }

    fn forward(
        &mut self,
        _: &Model,
        steps: &[(usize, i64, usize)],
        prefills: &[(usize, &[i64])],
    ) -> Result<(), ModelError> {
        let run = self.run.as_mut().expect("reserve runs before forward");
        let vocab = run.cpu.shape.vocab;
        self.logits.clear();
        if !steps.is_empty() {
            let ids: Vec<i64> = steps.iter().map(|s| s.1).collect();
            let rows: Vec<Row> = steps
                .iter()
                .map(|s| Row {
                    slot: s.0,
                    pos: s.2,
                })
                .collect();
            let all: Vec<usize> = (0..steps.len()).collect();
            // SAFETY: a `CpuSlots` is made only where the kernels apply (AVX2 and FMA).
            let logits = unsafe { run.forward(&ids, &rows, &all) };
            self.logits
                .extend_from_slice(&logits[..steps.len() * vocab]);
        }
        if !prefills.is_empty() {
            // SAFETY: as above.
            let first = unsafe { run.prefill(prefills) };
            self.logits.extend_from_slice(&first);
        }
        Ok(())
    }

    fn pick(
        &mut self,
        params: &[SamplingParams; 2],
        greedy: &[bool],
        uniforms: &[f32],
    ) -> Result<Vec<Pick>, ModelError> {
        let vocab = self.logits.len() / greedy.len().max(1);
        Ok(self
            .logits
            .chunks_mut(vocab.max(1))
            .zip(greedy.iter().zip(uniforms))
            .map(|(row, (&g, &u))| {
                // SAFETY: as in `forward`.
                unsafe { self.picker.pick(row, &params[usize::from(g)], u) }
            })
            .collect())
    }

    fn free(&mut self, _: &[usize]) -> Result<(), ModelError> {
        // A slot's positions are written before they are read again.
        Ok(())
    }

    fn clear(&mut self, model: &Model) {
        if let Some(run) = self.run.take() {
            run.finish(model);
        }
    }

    fn weights_changed(&mut self) {
        self.repack = true;
    }
}
