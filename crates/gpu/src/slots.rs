//! The decoder backends' common face ([`Slots`]: cache slots, forward
//! passes, token picks), and its libtorch implementation ([`TorchSlots`]);
//! weir's CPU kernels implement it in `cpu::run`.

use tch::{Kind, Tensor};

use crate::error::ModelError;
use crate::model::Model;
use crate::sampling::{pick, Pick, SamplingParams};

/// A decoder backend: cache slots, forward passes over them, and the pick
/// of the next tokens. The [`Streamer`](crate::stream::Streamer) and batch
/// generation drive either backend through it.
pub(crate) trait Slots {
    /// Makes room for sequences of `positions` positions, keeping the first
    /// `len` positions of every `(slot, len)` in `live`.
    fn reserve(
        &mut self,
        model: &Model,
        positions: usize,
        live: &[(usize, usize)],
    ) -> Result<(), ModelError>;

    /// Runs `steps` (slot, token, position: one token each, after what the
    /// slot holds) and `prefills` (slot, context: a whole context into an
    /// empty slot); afterwards the next-token logits of those slots are
    /// ready, steps first, in the order given.
    fn forward(
        &mut self,
        model: &Model,
        steps: &[(usize, i64, usize)],
        prefills: &[(usize, &[i64])],
    ) -> Result<(), ModelError>;

    /// Picks one token per ready row with the row's uniform number, under
    /// `params[0]` (the sampling settings), or `params[1]` (greedy) where
    /// `greedy[i]`.
    fn pick(
        &mut self,
        params: &[SamplingParams; 2],
        greedy: &[bool],
        uniforms: &[f32],
    ) -> Result<Vec<Pick>, ModelError>;

    /// The sequences of `slots` ended.
    fn free(&mut self, slots: &[usize]) -> Result<(), ModelError>;

    /// Forgets every cached position and hands memory back (nothing in flight).
    fn clear(&mut self, model: &Model);

    /// The model's weights changed: repack what was packed from them.
    fn weights_changed(&mut self);
}

/// The libtorch backend: a slot cache ([`crate::kv_cache::KvCache::slots`])
/// whose rows are the sequences in flight (`rows[i]` is row i's slot). A
/// sequence that joins is prefilled beside the others (right-padded, plain
/// causal attention) and copied into a row of its own; one that leaves
/// gives its row to the last row. Neither copies the other rows.
pub(crate) struct TorchSlots {
    layers: usize,
    cache: crate::kv_cache::KvCache,
    rows: Vec<usize>,
    logits: Option<Tensor>,
    /// Contexts prefilled, and sequences they started.
    prefilled: (usize, usize),
}

impl TorchSlots {
    pub(crate) fn new(model: &Model) -> Self {
        let layers = model.decoder.num_layers();
        TorchSlots {
            layers,
            cache: crate::kv_cache::KvCache::slots(layers),
            rows: Vec::new(),
            logits: None,
            prefilled: (0, 0),
        }
    }

    /// One token for every row, in `steps`' order; returns their logits.
    fn step(&mut self, model: &Model, steps: &[(usize, i64, usize)]) -> Result<Tensor, ModelError> {
        let device = model.device();
        let at: std::collections::HashMap<usize, usize> =
            steps.iter().enumerate().map(|(i, s)| (s.0, i)).collect();
        if at.len() != self.rows.len() || self.rows.iter().any(|r| !at.contains_key(r)) {
            return Err(ModelError::Input(
                "a decode step must cover every sequence in the cache".into(),
            ));
        }
        let lens = self.cache.row_lens();
        if let Some((row, _)) = self
            .rows
            .iter()
            .zip(lens)
            .find(|&(r, &len)| steps[at[r]].2 as i64 != len)
        {
            return Err(ModelError::Input(format!(
                "slot {row}'s next position is not the one after its cached context"
            )));
        }
        let ids: Vec<i64> = self.rows.iter().map(|r| steps[at[r]].1).collect();
        let b = ids.len() as i64;
        let ids = Tensor::from_slice(&ids).view([b, 1]).to_device(device);
        let (mask, positions) = self.cache.begin_step(device);
        let hidden = model.forward_cached(&ids, &mask, &positions, &mut self.cache);
        self.cache.end_step();
        let logits = model.lm_logits(&hidden.squeeze_dim(1))?;
        // Back into the caller's order.
        let row_of: std::collections::HashMap<usize, i64> = self
            .rows
            .iter()
            .enumerate()
            .map(|(i, &r)| (r, i as i64))
            .collect();
        let back: Vec<i64> = steps.iter().map(|s| row_of[&s.0]).collect();
        Ok(logits.index_select(0, &Tensor::from_slice(&back).to_device(device)))
    }

    /// Runs `prefills` as one right-padded batch and joins them to the
    /// cache. Equal contexts run once (a group's samples share their
    /// prompt): each gets a copy of its context's keys and values.
    fn prefill(
        &mut self,
        model: &Model,
        prefills: &[(usize, &[i64])],
    ) -> Result<Tensor, ModelError> {
        let device = model.device();
        let (contexts, of) = distinct(prefills.iter().map(|p| p.1));
        self.prefilled.0 += contexts.len();
        self.prefilled.1 += prefills.len();
        let width = contexts.iter().map(|c| c.len()).max().unwrap_or(0);
        let pad = model.config.pad_token_id.unwrap_or(0).max(0);
        let mut ids = Vec::with_capacity(contexts.len() * width);
        for context in &contexts {
            ids.extend(
                context
                    .iter()
                    .copied()
                    .chain(std::iter::repeat_n(pad, width - context.len())),
            );
        }
        let (p, w) = (contexts.len() as i64, width as i64);
        let ids = Tensor::from_slice(&ids).view([p, w]).to_device(device);
        let positions = Tensor::arange(w, (Kind::Int64, device))
            .view([1, w])
            .expand([p, w], false);
        // Padding only follows a row's tokens, so plain causal attention
        // (no bias tensor) gives each token what an unpadded row would.
        let mut cache = crate::kv_cache::KvCache::new(self.layers);
        let hidden = model
            .decoder
            .forward(&ids, None, &positions, Some(&mut cache));
        let lens: Vec<i64> = contexts.iter().map(|c| c.len() as i64).collect();
        let last = Tensor::from_slice(&lens).to_device(device) - 1;
        let rows = Tensor::arange(p, (Kind::Int64, device));
        let logits = model.lm_logits(&hidden.index(&[Some(rows), Some(last)]))?;
        let lens: Vec<i64> = of.iter().map(|&c| lens[c]).collect();
        // Each sequence's row of the prefill, where contexts were shared.
        let from = (contexts.len() < prefills.len()).then(|| {
            let of: Vec<i64> = of.iter().map(|&c| c as i64).collect();
            Tensor::from_slice(&of).to_device(device)
        });
        let logits = match &from {
            Some(from) => logits.index_select(0, from),
            None => logits,
        };
        self.cache.admit(&cache, &lens, from.as_ref());
        self.rows.extend(prefills.iter().map(|p| p.0));
        Ok(logits)
    }

    /// Contexts prefilled and sequences they started, since this backend was made.
    #[cfg(test)]
    fn prefilled(&self) -> (usize, usize) {
        self.prefilled
    }
}

/// The distinct items of `items` in first-seen order, and each item's index among them.
fn distinct<'a>(items: impl Iterator<Item = &'a [i64]>) -> (Vec<&'a [i64]>, Vec<usize>) {
    let mut seen: std::collections::HashMap<&[i64], usize> = std::collections::HashMap::new();
    let mut unique = Vec::new();
    let of = items
        .map(|item| {
            *seen.entry(item).or_insert_with(|| {
                unique.push(item);
                unique.len() - 1
            })
        })
        .collect();
    (unique, of)
}

impl Slots for TorchSlots {
    fn reserve(&mut self, _: &Model, _: usize, _: &[(usize, usize)]) -> Result<(), ModelError> {
        // The cache grows as it goes.
        Ok(())
    }

    fn forward(
        &mut self,
        model: &Model,
        steps: &[(usize, i64, usize)],
        prefills: &[(usize, &[i64])],
    ) -> Result<(), ModelError> {
        let _guard = tch::no_grad_guard();
        let mut parts = Vec::new();
        if !steps.is_empty() {
            parts.push(self.step(model, steps)?);
        }
        if !prefills.is_empty() {
            parts.push(self.prefill(model, prefills)?);
        }
        self.logits = Some(Tensor::cat(&parts, 0));
        Ok(())
    }

    fn pick(
        &mut self,
        params: &[SamplingParams; 2],
        greedy: &[bool],
        uniforms: &[f32],
    ) -> Result<Vec<Pick>, ModelError> {
        let _guard = tch::no_grad_guard();
        let logits = self.logits.take().expect("forward ran before pick");
        let mut out = vec![Pick::default(); greedy.len()];
        for (want, params) in [false, true].into_iter().zip(params) {
            let idx: Vec<i64> = (0..greedy.len() as i64)
                .filter(|&i| greedy[i as usize] == want)
                .collect();
            if idx.is_empty() {
                continue;
            }
            let rows = Tensor::from_slice(&idx).to_device(logits.device());
            let u: Vec<f32> = idx.iter().map(|&i| uniforms[i as usize]).collect();
            let (tokens, logprobs, squares) = pick(&logits.index_select(0, &rows), params, &u);
            let torch = |e: tch::TchError| ModelError::Torch(e.to_string());
            let tokens = Vec::<i64>::try_from(&tokens).map_err(torch)?;
            let floats = |t: &Tensor| Vec::<f32>::try_from(&t.to_kind(Kind::Float)).map_err(torch);
            let logprobs = floats(&logprobs)?;
            let squares = match &squares {
                Some(s) => floats(s)?,
                None => vec![0.0; tokens.len()],
            };
            for (((&i, token), logprob), sum_pi_squared) in
                idx.iter().zip(tokens).zip(logprobs).zip(squares)
            {
                out[i as usize] = Pick {
                    token,
                    logprob,
                    sum_pi_squared,
                };
            }
        }
        Ok(out)
    }

    fn free(&mut self, slots: &[usize]) -> Result<(), ModelError> {
        let gone: Vec<usize> = (0..self.rows.len())
            .filter(|&i| slots.contains(&self.rows[i]))
            .collect();
        for (from, to) in self.cache.remove(&gone) {
            self.rows[to] = self.rows[from];
        }
        self.rows.truncate(self.rows.len() - gone.len());
        Ok(())
    }

    fn clear(&mut self, _: &Model) {
        self.cache = crate::kv_cache::KvCache::slots(self.layers);
        self.rows.clear();
        self.logits = None;
    }

    fn weights_changed(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;

    /// `slots`' logits after its last forward pass (taken).
    fn logits(slots: &mut TorchSlots) -> Tensor {
        slots.logits.take().expect("a forward pass ran")
    }

    fn close(a: &Tensor, b: &Tensor) -> bool {
        f64::try_from((a - b).abs().max()).unwrap() < 1e-5
    }

    #[test]
    fn equal_contexts_are_prefilled_once_and_decode_as_if_each_had_run_alone() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/tiny-llama");
        let model = Model::load(&dir, Device::Cpu, Kind::Float).unwrap();
        let (a, b): (Vec<i64>, Vec<i64>) = (vec![1, 5, 9, 12, 30], vec![1, 7, 3]);
        let mut shared = TorchSlots::new(&model);
        shared
            .forward(&model, &[], &[(0, &a), (1, &b), (2, &a)])
            .unwrap();
        assert_eq!(
            shared.prefilled(),
            (2, 3),
            "a ran once for its two sequences"
        );
        let together = logits(&mut shared);
        let mut alone = TorchSlots::new(&model);
        alone.forward(&model, &[], &[(0, &a)]).unwrap();
        let first = logits(&mut alone);
        assert!(together.get(0).equal(&together.get(2)));
        assert!(close(&together.get(0), &first.get(0)));
        // Each sequence's keys are its own: a's two sequences decode
        // different tokens, and the first still decodes as a alone does.
        shared
            .forward(&model, &[(0, 40, 5), (1, 41, 3), (2, 42, 5)], &[])
            .unwrap();
        let step = logits(&mut shared);
        alone.forward(&model, &[(0, 40, 5)], &[]).unwrap();
        assert!(close(&step.get(0), &logits(&mut alone).get(0)));
        assert!(!close(&step.get(0), &step.get(2)));
        // The first leaves; the second goes on as a alone with its token.
        shared.free(&[0]).unwrap();
        shared
            .forward(&model, &[(1, 43, 4), (2, 44, 6)], &[])
            .unwrap();
        let later = logits(&mut shared);
        let mut other = TorchSlots::new(&model);
        other.forward(&model, &[], &[(2, &a)]).unwrap();
        other.forward(&model, &[(2, 42, 5)], &[]).unwrap();
        other.forward(&model, &[(2, 44, 6)], &[]).unwrap();
        assert!(close(&later.get(1), &logits(&mut other).get(0)));
    }
}
