//! Prompt + response rows: packed for one forward pass, and the forward
//! (and backward) passes over them that read the response positions —
//! log-probs, entropy, and the training step's loss — for the learner, the
//! reference, SFT and the preference trainers.

use tch::Tensor;
use weir_gpu::Model;
use weir_graph::StageError;

/// Right-padded `prompt ++ response` rows, and for each response token `j`
/// of row `i` the position `len(prompt_i) − 1 + j` that predicts it — the
/// index into token log-probs (entry `t − 1` is `log p(token t | < t)`) and
/// into per-position critic values alike.
pub struct Packed {
    /// Token ids `[B, T]`.
    pub ids: Tensor,
    /// Attention mask `[B, T]`.
    pub mask: Tensor,
    /// Predicting positions `[B, R]` (R = the longest response; padded entries repeat the last).
    pub index: Tensor,
    /// 1.0 on real response tokens `[B, R]`.
    pub response_mask: Tensor,
}

/// Packs `prompts[i] ++ responses[i]`, padding with `pad`, on `device`.
pub fn pack(prompts: &[Vec<i64>], responses: &[Vec<i64>], pad: i64, device: tch::Device) -> Packed {
    let width = prompts
        .iter()
        .zip(responses)
        // An empty response still gets one (padded) slot to be read at.
        .map(|(p, r)| p.len() + r.len().max(1))
        .max()
        .unwrap_or(1);
    let r_max = responses.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let (mut ids, mut mask, mut index, mut rmask) = (vec![], vec![], vec![], vec![]);
    for (p, r) in prompts.iter().zip(responses) {
        let len = p.len() + r.len();
        ids.extend(
            p.iter()
                .chain(r)
                .copied()
                .chain(std::iter::repeat_n(pad, width - len)),
        );
        mask.extend(std::iter::repeat_n(1i64, len).chain(std::iter::repeat_n(0, width - len)));
        for j in 0..r_max {
            index.push((p.len() + j.min(r.len().saturating_sub(1))) as i64 - 1);
            rmask.push(if j < r.len() { 1.0f32 } else { 0.0 });
        }
    }
    let (b, w, r) = (prompts.len() as i64, width as i64, r_max as i64);
    Packed {
        ids: Tensor::from_slice(&ids).view([b, w]).to_device(device),
        mask: Tensor::from_slice(&mask).view([b, w]).to_device(device),
        index: Tensor::from_slice(&index).view([b, r]).to_device(device),
        response_mask: Tensor::from_slice(&rmask).view([b, r]).to_device(device),
    }
}

/// Log-probs `[B, R]` of each row's response tokens given its prompt (at
/// `temperature`), with the response mask `[B, R]` (R = the longest
/// response), without gradients. A float32 model on an AVX2 CPU runs on
/// weir's CPU kernels (equal prompts, e.g. a group's samples, run once);
/// anything else through [`response_forward`].
pub fn response_logprobs(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    temperature: f64,
) -> Result<(Tensor, Tensor), StageError> {
    if !weir_gpu::generate::cpu_kernels_apply(model) {
        let _guard = tch::no_grad_guard();
        let f = response_forward(model, prompts, responses, temperature, false)?;
        return Ok((f.logprobs, f.mask));
    }
    let rows = weir_gpu::logprobs::response_logprobs_on_cpu_kernels(
        model,
        prompts,
        responses,
        temperature,
    )?;
    let width = responses.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let mut logprobs = Vec::with_capacity(rows.len() * width);
    let mut mask = Vec::with_capacity(rows.len() * width);
    for row in &rows {
        logprobs.extend(
            row.iter()
                .copied()
                .chain(std::iter::repeat_n(0.0, width - row.len())),
        );
        mask.extend(
            std::iter::repeat_n(1.0f32, row.len())
                .chain(std::iter::repeat_n(0.0, width - row.len())),
        );
    }
    let shape = [rows.len() as i64, width as i64];
    Ok((
        Tensor::from_slice(&logprobs)
            .view(shape)
            .to_device(model.device()),
        Tensor::from_slice(&mask)
            .view(shape)
            .to_device(model.device()),
    ))
}

/// One forward pass over `prompt ++ response` rows, read at the response positions.
pub struct ResponseForward {
    /// `log p(response token | prefix)` `[B, R]`.
    pub logprobs: Tensor,
    /// 1.0 on real response tokens `[B, R]`.
    pub mask: Tensor,
    /// The policy's entropy at each response position `[B, R]`, if asked for.
    pub entropy: Option<Tensor>,
}

/// Log-probs (and optionally entropy) of each row's response tokens: the
/// logits are gathered at the predicting positions first, so the softmax
/// runs over `R` positions per row, not the whole sequence. When rows share
/// prompts (a group's samples), each distinct prompt runs once
/// ([`Model::response_logits`]).
pub fn response_forward(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    temperature: f64,
    with_entropy: bool,
) -> Result<ResponseForward, StageError> {
    let (at, targets, mask) = response_logits(model, prompts, responses)?;
    Ok(read_responses(
        &at,
        &targets,
        mask,
        temperature,
        with_entropy,
    ))
}

/// True when some rows share a prompt.
fn prompts_repeat(prompts: &[Vec<i64>]) -> bool {
    let distinct: std::collections::HashSet<&[i64]> = prompts.iter().map(Vec::as_slice).collect();
    distinct.len() < prompts.len()
}

/// Logits at the positions predicting each response token `[B, R, vocab]`,
/// the tokens `[B, R]` and the response mask `[B, R]`.
fn response_logits(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
) -> Result<(Tensor, Tensor, Tensor), StageError> {
    if prompts_repeat(prompts) {
        let r = model.response_logits(prompts, responses)?;
        return Ok((r.logits, r.targets, r.mask));
    }
    let pad = model.config.pad_token_id.unwrap_or(0).max(0);
    let packed = pack(prompts, responses, pad, model.device());
    let logits = model.logits(&packed.ids, Some(&packed.mask), None)?;
    Ok(gather_responses(&logits, packed))
}

/// The response positions of `logits` `[B, T, vocab]` over `packed` rows:
/// (logits `[B, R, vocab]`, targets `[B, R]`, mask `[B, R]`).
fn gather_responses(logits: &Tensor, packed: Packed) -> (Tensor, Tensor, Tensor) {
    let vocab = logits.size()[2];
    let at = logits.gather(
        1,
        &packed.index.unsqueeze(-1).expand([-1, -1, vocab], false),
        false,
    );
    let targets = packed.ids.gather(1, &(&packed.index + 1), false);
    (at, targets, packed.response_mask)
}

/// Log-probs (and entropy) from the logits at the response positions.
fn read_responses(
    at: &Tensor,
    targets: &Tensor,
    mask: Tensor,
    temperature: f64,
    with_entropy: bool,
) -> ResponseForward {
    ResponseForward {
        logprobs: weir_gpu::logprobs::gather_logprobs(at, targets, temperature),
        mask,
        entropy: with_entropy.then(|| weir_gpu::logprobs::entropy(at, temperature)),
    }
}

/// A training forward and backward pass over `prompt ++ response` rows:
/// `loss_of` turns the [`ResponseForward`] into the loss to backpropagate
/// (and anything else it measured, returned). With `checkpointed`, layer
/// activations are recomputed in the backward pass instead of kept
/// ([`Model::backward_checkpointed`]); the gradients are the same.
pub fn response_backward<T>(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    temperature: f64,
    with_entropy: bool,
    checkpointed: bool,
    loss_of: impl FnOnce(ResponseForward) -> Result<(Tensor, T), StageError>,
) -> Result<T, StageError> {
    if !checkpointed {
        let fwd = response_forward(model, prompts, responses, temperature, with_entropy)?;
        let (loss, measured) = loss_of(fwd)?;
        loss.backward();
        return Ok(measured);
    }
    let pad = model.config.pad_token_id.unwrap_or(0).max(0);
    let packed = pack(prompts, responses, pad, model.device());
    let (ids, mask) = (packed.ids.shallow_clone(), packed.mask.shallow_clone());
    let mut measured = None;
    let _loss = model.backward_checkpointed(&ids, Some(&mask), |logits| {
        let (at, targets, mask) = gather_responses(logits, packed);
        let (loss, m) = loss_of(read_responses(
            &at,
            &targets,
            mask,
            temperature,
            with_entropy,
        ))?;
        measured = Some(m);
        Ok::<_, StageError>(loss)
    })?;
    Ok(measured.expect("loss_of ran"))
}

/// Each row's `column` text tokenised (no special tokens) with the
/// tokenizer's first eos id appended: the targets of SFT and preference pairs.
pub fn response_targets(
    batch: &arrow::array::RecordBatch,
    column: &str,
    tokenizer: &weir_gpu::Tokenizer,
    stage: &str,
) -> Result<Vec<Vec<i64>>, weir_graph::StageError> {
    let eos = *tokenizer.eos_token_ids().first().ok_or_else(|| {
        format!(
            "{}: the tokenizer has no eos token to end responses with",
            tokenizer.dir().display()
        )
    })?;
    super::columns::strings(batch, column, stage)?
        .iter()
        .map(|t| {
            let mut ids = tokenizer.encode(t, false)?;
            ids.push(eos);
            Ok(ids)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_points_at_the_predicting_positions() {
        let p = pack(
            &[vec![1, 2, 3], vec![4]],
            &[vec![9, 8], vec![7, 6, 5]],
            0,
            tch::Device::Cpu,
        );
        assert_eq!(
            Vec::<i64>::try_from(p.ids.flatten(0, -1)).unwrap(),
            vec![1, 2, 3, 9, 8, 4, 7, 6, 5, 0]
        );
        assert_eq!(
            Vec::<i64>::try_from(p.index.flatten(0, -1)).unwrap(),
            vec![2, 3, 3, 0, 1, 2]
        );
        assert_eq!(
            Vec::<f32>::try_from(p.response_mask.flatten(0, -1)).unwrap(),
            vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
        );
    }
}
