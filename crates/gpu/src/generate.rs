//! Batched generation on a chosen backend (weir's CPU kernels, `cpu::run`,
//! or libtorch through [`TorchSlots`]: every row prefilled into a slot
//! cache, then KV-cache decoding, one token per step for every unfinished
//! sequence), and no-grad response log-probs on the CPU kernels.
//!
//! Sampling happens on the model's device ([`crate::sampling`]); only one
//! uniform number per sequence goes up and one token id per sequence comes
//! back each step. Each sequence draws from its own random stream, seeded
//! by (seed, prompt, sample), so its tokens do not depend on what else is
//! in the batch. Finished sequences leave the batch (and the cache).

use crate::error::ModelError;
use crate::model::Model;
use crate::sampling::Stream;
pub use crate::sampling::{
    temperature_error, top_p_error, Backend, FinishReason, Generation, SamplingParams,
};
use crate::slots::{Slots, TorchSlots};

/// Generates `params.n` continuations of each prompt; results are ordered by
/// (prompt, sample). Sample `s` of prompt `p` draws from the stream
/// (`params.seed`, `p`, `s`), whatever else is in the batch.
pub fn generate(
    model: &Model,
    prompts: &[Vec<i64>],
    params: &SamplingParams,
) -> Result<Vec<Generation>, ModelError> {
    let ids: Vec<u64> = (0..prompts.len() as u64).collect();
    generate_with_ids(model, prompts, &ids, params)
}

/// Like [`generate`], but prompt `i` draws from the streams of `stream_ids[i]`
/// (e.g. its index in a whole dataset), so results do not depend on how the
/// prompts were batched. `Generation::prompt` is still the index in `prompts`.
pub fn generate_with_ids(
    model: &Model,
    prompts: &[Vec<i64>],
    stream_ids: &[u64],
    params: &SamplingParams,
) -> Result<Vec<Generation>, ModelError> {
    generate_on(model, prompts, stream_ids, params, Backend::Auto)
}

/// [`generate_with_ids`] on a chosen [`Backend`].
pub fn generate_on(
    model: &Model,
    prompts: &[Vec<i64>],
    stream_ids: &[u64],
    params: &SamplingParams,
    backend: Backend,
) -> Result<Vec<Generation>, ModelError> {
    params.validate()?;
    if stream_ids.len() != prompts.len() {
        return Err(ModelError::Input(format!(
            "{} stream ids for {} prompts",
            stream_ids.len(),
            prompts.len()
        )));
    }
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    model.check_token_ids(prompts, &[])?;
    if params.max_new_tokens == 0 {
        return Ok(Generation::empty_rows(prompts.len(), params.n));
    }
    let out = if backend == Backend::Auto && model.runs_on_cpu_kernels() {
        #[cfg(target_arch = "x86_64")]
        {
            crate::cpu::run::generate(model, prompts, stream_ids, params)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("the CPU kernels apply only on x86-64")
    } else {
        model.check_weights_held()?;
        generate_torch(model, prompts, stream_ids, params)
    };
    // The generation's activations and KV cache are freed: give their pages back.
    crate::device::release_freed_host_memory();
    out
}

/// `log p(responses[r][j] | prompts[r] ++ responses[r][..j])` at
/// `temperature` for every response token, without gradients, on weir's CPU
/// kernels (equal prompts run once). An error where they do not apply
/// ([`Model::runs_on_cpu_kernels`]): use `Model::logits` there.
pub fn response_logprobs_on_cpu_kernels(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    temperature: f64,
) -> Result<Vec<Vec<f32>>, ModelError> {
    if prompts.len() != responses.len() {
        return Err(ModelError::Input(format!(
            "{} prompts for {} responses",
            prompts.len(),
            responses.len()
        )));
    }
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(ModelError::Input(format!(
            "temperature must be positive, got {temperature}"
        )));
    }
    model.check_token_ids(prompts, responses)?;
    if !model.runs_on_cpu_kernels() {
        return Err(ModelError::Input(
            "the CPU kernels need a float32 causal LM on an x86-64 CPU with AVX2 and FMA".into(),
        ));
    }
    #[cfg(target_arch = "x86_64")]
    {
        let rows = crate::cpu::run::response_logprobs(model, prompts, responses, temperature);
        // The kernels' activations and cache are freed: give their pages
        // back, when the pass's keys, values and logits were large enough to matter.
        let c = &model.config;
        let tokens: usize = prompts
            .iter()
            .zip(responses)
            .map(|(p, r)| p.len() + r.len())
            .sum();
        let per_token =
            (2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim + c.vocab_size) * 4;
        crate::device::release_freed_host_memory_after(tokens * per_token.max(0) as usize);
        rows
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("the CPU kernels run nothing off x86-64")
}

/// Batch-level generation on libtorch ops: every row prefilled at once
/// into a slot cache (the streaming pool's, [`TorchSlots`]), then one
/// decode step per token over the rows still going; a row that ends leaves
/// the cache without the others being copied.
fn generate_torch(
    model: &Model,
    prompts: &[Vec<i64>],
    stream_ids: &[u64],
    params: &SamplingParams,
) -> Result<Vec<Generation>, ModelError> {
    let rows: Vec<(usize, usize)> = (0..prompts.len())
        .flat_map(|p| (0..params.n).map(move |s| (p, s)))
        .collect();
    let mut streams: Vec<Stream> = rows
        .iter()
        .map(|&(p, s)| Stream::new(params.seed, stream_ids[p], s as u64))
        .collect();
    let mut out: Vec<Generation> = rows
        .iter()
        .map(|&(prompt, sample)| Generation::empty(prompt, sample))
        .collect();
    let mut slots = TorchSlots::new(model);
    let prefills: Vec<(usize, &[i64])> = rows
        .iter()
        .enumerate()
        .map(|(r, &(p, _))| (r, prompts[p].as_slice()))
        .collect();
    slots.forward(model, &[], &prefills)?;
    let both = [params.clone(), params.clone()];
    // The rows whose logits are ready, in their order (a row's slot is its index).
    let mut active: Vec<usize> = (0..rows.len()).collect();
    loop {
        let uniforms: Vec<f32> = active.iter().map(|&r| streams[r].next_f32()).collect();
        let picks = slots.pick(&both, &vec![false; active.len()], &uniforms)?;
        let (mut steps, mut ended) = (Vec::new(), Vec::new());
        for (&r, &pick) in active.iter().zip(&picks) {
            if out[r].record(pick, params) {
                let token = pick.token;
                let position = prompts[rows[r].0].len() + out[r].tokens.len() - 1;
                steps.push((r, token, position));
            } else {
                ended.push(r);
            }
        }
        if steps.is_empty() {
            break;
        }
        slots.free(&ended)?;
        active = steps.iter().map(|s| s.0).collect();
        slots.forward(model, &steps, &[])?;
    }
    Ok(out)
}
