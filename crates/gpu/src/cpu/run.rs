//! Calls on the CPU kernels: generation and no-grad response log-probs.
//!
//! Each sequence has its own cache slot and no padding. Each distinct prompt
//! is prefilled once and its keys and values are copied to the slots of the
//! other rows that share it (a group's samples, or a batch that repeats
//! prompts itself, as the RL prompt source sends them).

use std::collections::HashMap;
use std::sync::Arc;

use super::engine::CpuModel;
use super::prepared::Prepared;
use super::sample::Picker;
use super::state::{Cache, RopeTables, Row, Scratch};
use crate::generate::{Generation, SamplingParams, Stream};
use crate::{Model, ModelError};

/// Prompt tokens run through the model at once during prefill.
const PREFILL_ROWS: usize = 256;

/// One call's state: the packed model, RoPE tables, cache, activations and
/// thread pool.
struct Run<'m> {
    prepared: &'m Prepared,
    cpu: Arc<CpuModel>,
    rope: RopeTables,
    cache: Cache,
    scratch: Scratch,
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl<'m> Run<'m> {
    /// `slots` sequences of up to `capacity` positions on `model`.
    fn start(model: &'m Model, slots: usize, capacity: usize) -> Result<Self, ModelError> {
        let prepared = model.prepared_for_cpu();
        let cpu = prepared.model(model)?;
        let cache = Cache::new(prepared.take_cache(), slots, &cpu, capacity);
        Ok(Run {
            prepared,
            rope: RopeTables::new(model, capacity)?,
            cache,
            scratch: Scratch::default(),
            pool: prepared.pool()?,
            cpu,
        })
    }

    /// [`CpuModel::forward`] on this call's state.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    unsafe fn forward(&mut self, ids: &[i64], rows: &[Row], logit_rows: &[usize]) -> &[f32] {
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

    /// Runs each prompt `p` with `owner[p] == p` (the first of equal prompts)
    /// into the slot of its first sample, then copies its keys and values to
    /// the slots of every sample of every prompt equal to it; returns the
    /// logits after each such prompt's last token, `[prompts, vocab]` (other
    /// rows are left at 0).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    unsafe fn prefill(&mut self, prompts: &[Vec<i64>], owner: &[usize], n: usize) -> Vec<f32> {
        let vocab = self.cpu.vocab;
        let mut first = vec![0.0f32; prompts.len() * vocab];
        let tokens: Vec<(usize, usize, i64)> = prompts
            .iter()
            .enumerate()
            .filter(|&(p, _)| owner[p] == p)
            .flat_map(|(p, prompt)| {
                prompt
                    .iter()
                    .enumerate()
                    .map(move |(pos, &id)| (p, pos, id))
            })
            .collect();
        for chunk in tokens.chunks(PREFILL_ROWS) {
            let ids: Vec<i64> = chunk.iter().map(|t| t.2).collect();
            let rows: Vec<Row> = chunk
                .iter()
                .map(|&(p, pos, _)| Row { slot: p * n, pos })
                .collect();
            let last: Vec<usize> = (0..chunk.len())
                .filter(|&i| chunk[i].1 + 1 == prompts[chunk[i].0].len())
                .collect();
            let logits = self.forward(&ids, &rows, &last);
            for (j, &i) in last.iter().enumerate() {
                let p = chunk[i].0;
                first[p * vocab..(p + 1) * vocab]
                    .copy_from_slice(&logits[j * vocab..(j + 1) * vocab]);
            }
        }
        for r in 0..prompts.len() * n {
            let (p, source) = (r / n, owner[r / n] * n);
            if r != source {
                self.cache.copy_prefix(source, r, prompts[p].len());
            }
        }
        first
    }

    /// Hands the cache buffer back for the next call.
    fn finish(self) {
        self.prepared.give_back_cache(self.cache.data);
    }
}

/// For each prompt, the index of the first prompt equal to it.
fn owners(prompts: &[Vec<i64>]) -> Vec<usize> {
    let mut seen: HashMap<&[i64], usize> = HashMap::new();
    prompts
        .iter()
        .enumerate()
        .map(|(p, prompt)| *seen.entry(prompt.as_slice()).or_insert(p))
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
    let vocab = run.cpu.vocab;
    let owner = owners(prompts);
    // SAFETY (all calls below): the caller checked that the CPU has AVX2 and FMA.
    let first = unsafe { run.prefill(prompts, &owner, n) };
    let mut streams: Vec<Stream> = (0..out.len())
        .map(|r| Stream::new(params.seed, stream_ids[r / n], (r % n) as u64))
        .collect();
    let mut picker = Picker::default();
    let mut row_logits = Vec::with_capacity(vocab);
    // Live sequences: (output row = cache slot, last token, its position).
    let mut live: Vec<(usize, i64, usize)> = Vec::with_capacity(out.len());
    for (r, generation) in out.iter_mut().enumerate() {
        let (p, source) = (r / n, owner[r / n]);
        row_logits.clear();
        row_logits.extend_from_slice(&first[source * vocab..(source + 1) * vocab]);
        let (token, logprob) =
            unsafe { picker.pick(&mut row_logits, params, streams[r].next_f32()) };
        if generation.record(token, logprob, params) {
            live.push((r, token, prompts[p].len()));
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
            let (token, logprob) =
                unsafe { picker.pick(&mut row_logits, params, streams[r].next_f32()) };
            if out[r].record(token, logprob, params) {
                live[kept] = (r, token, pos + 1);
                kept += 1;
            }
        }
        live.truncate(kept);
    }
    run.finish();
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
    let vocab = run.cpu.vocab;
    let owner = owners(prompts);
    let temperature = temperature as f32;
    let (mut picker, mut row) = (Picker::default(), Vec::with_capacity(vocab));
    let mut logprob = |logits: &[f32], target: i64| {
        row.clear();
        row.extend(logits.iter().map(|&x| x / temperature));
        // SAFETY: the caller checked that the CPU has AVX2 and FMA.
        unsafe { picker.log_prob(&row, target as usize) }
    };
    // SAFETY (both calls): as above.
    let first = unsafe { run.prefill(prompts, &owner, 1) };
    let mut out: Vec<Vec<f32>> = responses
        .iter()
        .enumerate()
        .map(|(r, response)| {
            let mut lp = Vec::with_capacity(response.len());
            if let Some(&target) = response.first() {
                let o = owner[r];
                lp.push(logprob(&first[o * vocab..(o + 1) * vocab], target));
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
    run.finish();
    Ok(out)
}
