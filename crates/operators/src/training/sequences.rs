//! Prompt + response rows: packed for one forward pass, and the forward
//! (and backward) passes over them that read the response positions —
//! log-probs, entropy, and the training step's loss — for the learner, the
//! reference, SFT and the preference trainers.

use std::collections::HashMap;

use tch::Tensor;
use weir_gpu::logprobs::{HeadGrads, HeadReads};
use weir_gpu::{AttentionRow, Model, PackedLayout};
use weir_graph::StageError;

/// Right-padded `prompt ++ response` rows, and for each response token `j`
/// of row `i` the position `len(prompt_i) − 1 + j` that predicts it — the
/// index into token log-probs (entry `t − 1` is `log p(token t | < t)`) and
/// into per-position critic values alike.
///
/// The padding is on the right only, so a real token never attends to a
/// padding position: the model runs on `ids` with no attention mask (plain
/// causal attention, which lets SDPA choose a fused kernel).
pub struct Packed {
    /// Token ids `[B, T]`.
    pub ids: Tensor,
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
    let (mut ids, mut index, mut rmask) = (vec![], vec![], vec![]);
    for (p, r) in prompts.iter().zip(responses) {
        let len = p.len() + r.len();
        ids.extend(
            p.iter()
                .chain(r)
                .copied()
                .chain(std::iter::repeat_n(pad, width - len)),
        );
        for j in 0..r_max {
            index.push((p.len() + j.min(r.len().saturating_sub(1))) as i64 - 1);
            rmask.push(if j < r.len() { 1.0f32 } else { 0.0 });
        }
    }
    let (b, w, r) = (prompts.len() as i64, width as i64, r_max as i64);
    Packed {
        ids: Tensor::from_slice(&ids).view([b, w]).to_device(device),
        index: Tensor::from_slice(&index).view([b, r]).to_device(device),
        response_mask: Tensor::from_slice(&rmask).view([b, r]).to_device(device),
    }
}

/// `prompt ++ response` rows packed into one sequence, with no padding:
/// the model runs them as one row whose attention stays within each row
/// ([`Model::hidden_states_packed`]). A prompt that several rows share (a
/// group's samples) is packed once, and each of their responses attends
/// to it, so its layers run once for the group.
pub struct Flat {
    /// Token ids `[1, T]`, T the packed tokens.
    pub ids: Tensor,
    /// The positions and attention rows of the packed tokens.
    pub layout: PackedLayout,
    /// The position in the sequence predicting each response token `[B, R]`
    /// (R = the longest response; padded entries repeat the row's last).
    pub index: Tensor,
    /// The response tokens `[B, R]` (`pad` where a response is shorter).
    pub targets: Tensor,
    /// 1.0 on real response tokens `[B, R]`.
    pub response_mask: Tensor,
    /// The position predicting each real response token `[N]`, row by row.
    pub real: Tensor,
    /// Those tokens `[N]`.
    pub real_targets: Tensor,
    /// Their places in the `[B, R]` grid, flattened `[N]`.
    pub slots: Tensor,
}

/// Packs `prompts[i] ++ responses[i]`, a prompt several rows share once, on `device`.
pub fn pack_flat(
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    pad: i64,
    device: tch::Device,
) -> Flat {
    let r_max = responses.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let mut uses: HashMap<&[i64], usize> = HashMap::new();
    for p in prompts {
        *uses.entry(p.as_slice()).or_default() += 1;
    }
    // Where a shared prompt was packed.
    let mut shared: HashMap<&[i64], Vec<i64>> = HashMap::new();
    let (mut ids, mut positions, mut rows) = (Vec::new(), Vec::new(), Vec::new());
    let (mut index, mut targets, mut rmask) = (vec![], vec![], vec![]);
    let (mut real, mut real_targets, mut slots) = (vec![], vec![], vec![]);
    let mut append = |tokens: &[i64], from: i64, ids: &mut Vec<i64>| -> Vec<i64> {
        let at = ids.len() as i64;
        ids.extend_from_slice(tokens);
        positions.extend(from..from + tokens.len() as i64);
        (at..at + tokens.len() as i64).collect()
    };
    for (p, r) in prompts.iter().zip(responses) {
        let sharing = uses[p.as_slice()] > 1 && !p.is_empty();
        let prompt_at = match shared.get(p.as_slice()) {
            Some(at) => at.clone(),
            None => {
                let at = append(p, 0, &mut ids);
                if sharing {
                    rows.push(AttentionRow {
                        keys: at.clone(),
                        context: 0,
                    });
                    shared.insert(p.as_slice(), at.clone());
                }
                at
            }
        };
        let response_at = append(r, p.len() as i64, &mut ids);
        // The keys of the row: its prompt (context only when shared), then its response.
        let context = if sharing { p.len() } else { 0 };
        if !(sharing && r.is_empty()) {
            rows.push(AttentionRow {
                keys: prompt_at.iter().chain(&response_at).copied().collect(),
                context,
            });
        }
        let predictor = |j: usize| -> i64 {
            if j == 0 {
                prompt_at.last().copied().unwrap_or(0)
            } else {
                response_at[j - 1]
            }
        };
        for j in 0..r_max {
            index.push(predictor(j.min(r.len().saturating_sub(1))));
            targets.push(r.get(j).copied().unwrap_or(pad));
            rmask.push(if j < r.len() { 1.0f32 } else { 0.0 });
            if j < r.len() {
                slots.push(targets.len() as i64 - 1);
                real.push(predictor(j));
                real_targets.push(r[j]);
            }
        }
    }
    let (b, r) = (prompts.len() as i64, r_max as i64);
    let on_device = |v: &[i64]| Tensor::from_slice(v).to_device(device);
    Flat {
        ids: Tensor::from_slice(&ids).view([1, -1]).to_device(device),
        layout: PackedLayout { positions, rows },
        index: Tensor::from_slice(&index).view([b, r]).to_device(device),
        targets: Tensor::from_slice(&targets).view([b, r]).to_device(device),
        response_mask: Tensor::from_slice(&rmask).view([b, r]).to_device(device),
        real: on_device(&real),
        real_targets: on_device(&real_targets),
        slots: on_device(&slots),
    }
}

/// Log-probs (and what `reads` asks for besides) of packed rows' response
/// tokens from their states `[1, T, d]`, the output head run at the real
/// response positions only, laid out `[B, R]` (`[B, R, k]` for support
/// ids `[B, R, k]`; 0 where a response is shorter).
fn read_flat(
    model: &Model,
    states: &Tensor,
    flat: &Flat,
    temperature: f64,
    reads: HeadReads<'_>,
) -> Result<ResponseForward, StageError> {
    let at = states
        .squeeze_dim(0)
        .index_select(0, &flat.real)
        .unsqueeze(0);
    let logits = model.lm_logits(&at)?;
    let (b, r) = (flat.index.size()[0], flat.index.size()[1]);
    // The support ids at the real positions `[1, N, k]`.
    let support = reads.support.map(|ids| {
        let k = ids.size()[2];
        ids.view([b * r, k])
            .index_select(0, &flat.slots)
            .unsqueeze(0)
    });
    let read = read_responses(
        &logits,
        &flat.real_targets.unsqueeze(0),
        flat.response_mask.shallow_clone(),
        temperature,
        HeadReads {
            support: support.as_ref(),
            ..reads
        },
    );
    let grid = |x: Tensor| {
        let k = if x.dim() == 3 { x.size()[2] } else { 1 };
        let shape: &[i64] = if x.dim() == 3 { &[b, r, k] } else { &[b, r] };
        Tensor::zeros([b * r, k], (x.kind(), x.device()))
            .index_copy(0, &flat.slots, &x.view([-1, k]))
            .view(shape)
    };
    Ok(ResponseForward {
        logprobs: grid(read.logprobs),
        mask: read.mask,
        entropy: read.entropy.map(grid),
        support: read.support.map(grid),
    })
}

/// The response positions of packed `states` `[1, T, d]`: (`[B, R, d]`,
/// targets `[B, R]`, mask `[B, R]`).
fn gather_flat(states: &Tensor, flat: &Flat) -> (Tensor, Tensor, Tensor) {
    let (b, r) = (flat.index.size()[0], flat.index.size()[1]);
    let d = states.size()[2];
    let at = states
        .squeeze_dim(0)
        .index_select(0, &flat.index.flatten(0, -1))
        .view([b, r, d]);
    (
        at,
        flat.targets.shallow_clone(),
        flat.response_mask.shallow_clone(),
    )
}

/// [`pack`] with `model`'s padding id, on its device, after checking on
/// the host that every token id lies in its vocabulary (so no device
/// has to be asked).
pub fn pack_for(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
) -> Result<Packed, StageError> {
    let pad = checked_pad(model, prompts, responses)?;
    Ok(pack(prompts, responses, pad, model.device()))
}

/// `model`'s padding id, once every token id is checked on the host to lie
/// in its vocabulary (so no device has to be asked).
pub(crate) fn checked_pad(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
) -> Result<i64, StageError> {
    let vocab = model.config.vocab_size;
    if let Some(bad) = prompts
        .iter()
        .chain(responses)
        .flatten()
        .find(|&&id| id < 0 || id >= vocab)
    {
        return Err(format!(
            "token id {bad} is outside the vocabulary of {} (0..{vocab})",
            model.source.display()
        )
        .into());
    }
    Ok(model.config.pad_token_id.unwrap_or(0).max(0))
}

/// Log-probs `[B, R]` of each row's response tokens given its prompt (at
/// `temperature`), with the response mask `[B, R]` (R = the longest
/// response), without gradients. A float32 model on an AVX2 CPU runs on
/// weir's CPU kernels (equal prompts, e.g. a group's samples, run once);
/// anything else through [`response_forward`], or with `packed` as one
/// sequence without padding ([`pack_flat`], the output head at the real
/// response positions only), or with the output head applied `chunk`
/// positions at a time when the rows hold more (0: never).
pub fn response_logprobs(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    temperature: f64,
    chunk: usize,
    packed: bool,
) -> Result<(Tensor, Tensor), StageError> {
    if !model.runs_on_cpu_kernels() && packed {
        let _guard = tch::no_grad_guard();
        let pad = checked_pad(model, prompts, responses)?;
        let flat = pack_flat(prompts, responses, pad, model.device());
        let hidden = model.hidden_states_packed(&flat.ids, &flat.layout)?;
        if chunks(responses, chunk) {
            let (at, targets, mask) = gather_flat(&hidden, &flat);
            let f = head_in_chunks(model, &at, &targets, mask, temperature, chunk)?;
            return Ok((f.logprobs, f.mask));
        }
        let f = read_flat(model, &hidden, &flat, temperature, HeadReads::default())?;
        return Ok((f.logprobs, f.mask));
    }
    if !model.runs_on_cpu_kernels() {
        let _guard = tch::no_grad_guard();
        if chunks(responses, chunk) {
            let (hidden, targets, mask) = response_hidden(model, prompts, responses)?;
            let f = head_in_chunks(model, &hidden, &targets, mask, temperature, chunk)?;
            return Ok((f.logprobs, f.mask));
        }
        let f = response_forward(model, prompts, responses, temperature, None)?;
        return Ok((f.logprobs, f.mask));
    }
    let rows = weir_gpu::generate::response_logprobs_on_cpu_kernels(
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

/// A frozen model's reads of each row's response tokens with its most
/// likely tokens at each position ([`response_top_logprobs`]).
pub struct TopLogprobs {
    /// `log p(response token | prefix)` `[B, R]`.
    pub logprobs: Tensor,
    /// 1.0 on real response tokens `[B, R]`.
    pub mask: Tensor,
    /// The `k` largest log-probs at each position `[B, R, k]`, descending.
    pub top: Tensor,
    /// Their token ids `[B, R, k]`.
    pub ids: Tensor,
}

/// Which top tokens [`response_top_logprobs`] reads: the `k` most likely
/// among the ids below `below` (a student's vocabulary, where it is the
/// smaller; `None`: all ids).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TopTokens {
    /// How many.
    pub k: usize,
    /// Among the ids below this one only.
    pub below: Option<i64>,
}

/// Log-probs of each row's response tokens at `temperature` and the `top.k`
/// most likely tokens at each response position with their log-probs,
/// without gradients, on libtorch (the CUDA path; on the CPU too: the
/// CPU kernels read the sampled tokens only), the rows padded or `packed`,
/// the output head `chunk` positions at a time (0: all at once).
pub fn response_top_logprobs(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    temperature: f64,
    top: TopTokens,
    chunk: usize,
    packed: bool,
) -> Result<TopLogprobs, StageError> {
    let _guard = tch::no_grad_guard();
    let (hidden, targets, mask) = if packed {
        let pad = checked_pad(model, prompts, responses)?;
        let flat = pack_flat(prompts, responses, pad, model.device());
        let states = model.hidden_states_packed(&flat.ids, &flat.layout)?;
        gather_flat(&states, &flat)
    } else {
        response_hidden(model, prompts, responses)?
    };
    let (b, r, h) = hidden.size3().map_err(|e| e.to_string())?;
    let out = weir_gpu::logprobs::head_forward_chunked(
        &model.lm_weight()?,
        &hidden.reshape([b * r, h]),
        &targets.reshape([b * r]),
        temperature,
        HeadReads {
            top_k: top.k,
            top_below: top.below,
            ..HeadReads::default()
        },
        if chunk == 0 { (b * r) as usize } else { chunk },
    );
    let (top, ids) = out.top.ok_or("the output head read no top tokens")?;
    let k = top.size()[1];
    Ok(TopLogprobs {
        logprobs: out.logprobs.view([b, r]),
        mask,
        top: top.view([b, r, k]),
        ids: ids.view([b, r, k]),
    })
}

/// One forward pass over `prompt ++ response` rows, read at the response positions.
pub struct ResponseForward {
    /// `log p(response token | prefix)` `[B, R]`.
    pub logprobs: Tensor,
    /// 1.0 on real response tokens `[B, R]`.
    pub mask: Tensor,
    /// The policy's entropy at each response position `[B, R]`, if asked for.
    pub entropy: Option<Tensor>,
    /// The log-probs of support ids `[B, R, k]` (a teacher's top k), if asked for.
    pub support: Option<Tensor>,
}

/// Log-probs (and, at the temperature `entropy_at`, the entropy) of each
/// row's response tokens: the logits are gathered at the predicting
/// positions first, so the softmax runs over `R` positions per row, not
/// the whole sequence. When rows share
/// prompts (a group's samples), each distinct prompt runs once
/// ([`Model::response_logits`]).
pub fn response_forward(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    temperature: f64,
    entropy_at: Option<f64>,
) -> Result<ResponseForward, StageError> {
    let (at, targets, mask) = response_logits(model, prompts, responses)?;
    let reads = HeadReads {
        entropy_at,
        ..HeadReads::default()
    };
    Ok(read_responses(&at, &targets, mask, temperature, reads))
}

/// Whether `chunk` splits the output head's work over these responses:
/// more response positions (rows × the longest response) than `chunk`.
fn chunks(responses: &[Vec<i64>], chunk: usize) -> bool {
    let width = responses.iter().map(Vec::len).max().unwrap_or(1).max(1);
    chunk > 0 && responses.len() * width > chunk
}

/// The final hidden states at the positions predicting each response
/// token `[B, R, hidden]`, the tokens and the mask (differentiable).
fn response_hidden(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
) -> Result<(Tensor, Tensor, Tensor), StageError> {
    if prompts_repeat(prompts) {
        let r = model.response_hidden(prompts, responses)?;
        return Ok((r.logits, r.targets, r.mask));
    }
    let packed = pack_for(model, prompts, responses)?;
    let hidden = model.hidden_states(&packed.ids, None, None)?;
    Ok(gather_responses(&hidden, packed))
}

/// Log-probs from hidden states `[B, R, hidden]` through the output head
/// `chunk` positions at a time, without gradients.
fn head_in_chunks(
    model: &Model,
    hidden: &Tensor,
    targets: &Tensor,
    mask: Tensor,
    temperature: f64,
    chunk: usize,
) -> Result<ResponseForward, StageError> {
    let (b, r, h) = hidden.size3().map_err(|e| e.to_string())?;
    let out = weir_gpu::logprobs::head_forward_chunked(
        &model.lm_weight()?,
        &hidden.detach().reshape([b * r, h]),
        &targets.reshape([b * r]),
        temperature,
        HeadReads::default(),
        chunk,
    );
    Ok(ResponseForward {
        logprobs: out.logprobs.view([b, r]),
        mask,
        entropy: None,
        support: None,
    })
}

/// The training pass's head in chunks: log-probs (and what `reads` asks
/// for besides: the entropy, support ids' log-probs) from the detached
/// `hidden` `[B, R, hidden]`, `loss_of` on them as leaves, its gradient in
/// them carried back through the head chunk by chunk
/// ([`weir_gpu::logprobs::head_backward_chunked`]). Returns what `loss_of`
/// measured and a surrogate whose backward pass puts that gradient into
/// `hidden`'s graph and the head's weight: `Σ hidden · ∂L/∂hidden + Σ W · ∂L/∂W`.
#[allow(clippy::too_many_arguments)]
fn chunked_loss<T>(
    model: &Model,
    hidden: &Tensor,
    targets: &Tensor,
    mask: Tensor,
    temperature: f64,
    reads: HeadReads<'_>,
    chunk: usize,
    loss_of: impl FnOnce(ResponseForward) -> Result<(Tensor, T), StageError>,
) -> Result<(Tensor, T), StageError> {
    let (b, r, h) = hidden.size3().map_err(|e| e.to_string())?;
    let weight = model.lm_weight()?;
    let flat = hidden.detach().reshape([b * r, h]);
    let flat_targets = targets.reshape([b * r]);
    let flat_support = reads.support.map(|ids| ids.reshape([b * r, -1]));
    let out = weir_gpu::logprobs::head_forward_chunked(
        &weight,
        &flat,
        &flat_targets,
        temperature,
        HeadReads {
            support: flat_support.as_ref(),
            ..reads
        },
        chunk,
    );
    let leaf = |t: Tensor, shape: &[i64]| t.detach().view(shape).set_requires_grad(true);
    let logprobs = leaf(out.logprobs, &[b, r]);
    let entropy = out.entropy.map(|e| leaf(e, &[b, r]));
    let support = out.support.map(|s| {
        let k = s.size()[1];
        leaf(s, &[b, r, k])
    });
    let (loss, measured) = loss_of(ResponseForward {
        logprobs: logprobs.shallow_clone(),
        mask,
        entropy: entropy.as_ref().map(Tensor::shallow_clone),
        support: support.as_ref().map(Tensor::shallow_clone),
    })?;
    loss.backward();
    let grad = |t: &Tensor| {
        let g = t.grad();
        let g = if g.defined() { g } else { t.zeros_like() };
        g.reshape([b * r, -1]).squeeze_dim(-1)
    };
    let grad_logprobs = grad(&logprobs);
    let grad_entropy = entropy.as_ref().map(grad);
    // [b·r, k] even where k = 1.
    let grad_support = support.as_ref().map(|s| {
        let g = s.grad();
        let g = if g.defined() { g } else { s.zeros_like() };
        g.reshape([b * r, -1])
    });
    let (grad_hidden, grad_weight) = weir_gpu::logprobs::head_backward_chunked(
        &weight,
        &flat,
        &flat_targets,
        temperature,
        HeadGrads {
            logprobs: &grad_logprobs,
            entropy: grad_entropy.as_ref().zip(reads.entropy_at),
            support: flat_support.as_ref().zip(grad_support.as_ref()),
        },
        chunk,
    );
    let kind = hidden.kind();
    let surrogate =
        (hidden * grad_hidden.view([b, r, h])).sum(kind) + (&weight * grad_weight).sum(kind);
    Ok((surrogate, measured))
}

/// True when some rows share a prompt.
fn prompts_repeat(prompts: &[Vec<i64>]) -> bool {
    let distinct: std::collections::HashSet<&[i64]> = prompts.iter().map(Vec::as_slice).collect();
    distinct.len() < prompts.len()
}

/// Logits at the positions predicting each response token `[B, R, vocab]`
/// (the head applied there only), the tokens `[B, R]` and the response mask `[B, R]`.
fn response_logits(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
) -> Result<(Tensor, Tensor, Tensor), StageError> {
    let (hidden, targets, mask) = response_hidden(model, prompts, responses)?;
    Ok((model.lm_logits(&hidden)?, targets, mask))
}

/// The response positions of `states` `[B, T, d]` (hidden states or
/// logits) over `packed` rows: (`[B, R, d]`, targets `[B, R]`, mask `[B, R]`).
fn gather_responses(states: &Tensor, packed: Packed) -> (Tensor, Tensor, Tensor) {
    let width = states.size()[2];
    let at = states.gather(
        1,
        &packed.index.unsqueeze(-1).expand([-1, -1, width], false),
        false,
    );
    let targets = packed.ids.gather(1, &(&packed.index + 1), false);
    (at, targets, packed.response_mask)
}

/// Log-probs (and what `reads` asks for besides) from the logits at the
/// response positions.
fn read_responses(
    at: &Tensor,
    targets: &Tensor,
    mask: Tensor,
    temperature: f64,
    reads: HeadReads<'_>,
) -> ResponseForward {
    ResponseForward {
        logprobs: weir_gpu::logprobs::gather_logprobs(at, targets, temperature),
        mask,
        entropy: reads.entropy_at.map(|t| weir_gpu::logprobs::entropy(at, t)),
        support: reads
            .support
            .map(|ids| weir_gpu::logprobs::logprobs_at(at, ids, temperature)),
    }
}

/// A training forward and backward pass over `prompt ++ response` rows:
/// `loss_of` turns the [`ResponseForward`] into the loss to backpropagate
/// (and anything else it measured, returned). With `checkpointed`, layer
/// activations are recomputed in the backward pass instead of kept
/// ([`Model::backward_checkpointed`]); the gradients are the same. With
/// more response positions than `chunk` (> 0), the output head runs
/// `chunk` positions at a time forward and backward ([`chunked_loss`]), so
/// at most `chunk × vocab` logits exist at once; the gradients are the same.
/// With `packed`, the rows run as one sequence ([`pack_flat`]): no
/// position of padding, the same states, a prompt several rows share run
/// once. `reads` asks for the entropy and the log-probs of support ids
/// `[B, R, k]` (R the longest response) besides, as leaves of the loss.
#[allow(clippy::too_many_arguments)]
pub fn response_backward<T>(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    temperature: f64,
    reads: HeadReads<'_>,
    checkpointed: bool,
    chunk: usize,
    packed: bool,
    loss_of: impl FnOnce(ResponseForward) -> Result<(Tensor, T), StageError>,
) -> Result<T, StageError> {
    let chunked = chunks(responses, chunk);
    let _training = model.training();
    // The loss to backpropagate, from the hidden states at the response
    // positions (a grid `[B, R, d]`), or from packed rows' states, whose
    // output head runs at the real response positions only unless chunked.
    let head = |states: Responses<'_>| match states {
        Responses::Grid(hidden, targets, mask) if chunked => chunked_loss(
            model,
            hidden,
            &targets,
            mask,
            temperature,
            reads,
            chunk,
            loss_of,
        ),
        Responses::Grid(hidden, targets, mask) => {
            let logits = model.lm_logits(hidden)?;
            loss_of(read_responses(&logits, &targets, mask, temperature, reads))
        }
        Responses::Packed(states, flat) if chunked => {
            let (at, targets, mask) = gather_flat(states, flat);
            chunked_loss(
                model,
                &at,
                &targets,
                mask,
                temperature,
                reads,
                chunk,
                loss_of,
            )
        }
        Responses::Packed(states, flat) => {
            loss_of(read_flat(model, states, flat, temperature, reads)?)
        }
    };
    if packed {
        let pad = checked_pad(model, prompts, responses)?;
        let flat = pack_flat(prompts, responses, pad, model.device());
        if !checkpointed {
            let hidden = model.hidden_states_packed(&flat.ids, &flat.layout)?;
            let (loss, measured) = head(Responses::Packed(&hidden, &flat))?;
            loss.backward();
            return Ok(measured);
        }
        let mut measured = None;
        let _loss =
            model.backward_checkpointed_hidden_packed(&flat.ids, &flat.layout, |hidden| {
                let (loss, m) = head(Responses::Packed(hidden, &flat))?;
                measured = Some(m);
                Ok::<_, StageError>(loss)
            })?;
        return Ok(measured.expect("loss_of ran"));
    }
    if !checkpointed {
        let (hidden, targets, mask) = response_hidden(model, prompts, responses)?;
        let (loss, measured) = head(Responses::Grid(&hidden, targets, mask))?;
        loss.backward();
        return Ok(measured);
    }
    let packed = pack_for(model, prompts, responses)?;
    let ids = packed.ids.shallow_clone();
    let mut measured = None;
    let _loss = model.backward_checkpointed_hidden(&ids, None, |hidden| {
        let (at, targets, mask) = gather_responses(hidden, packed);
        let (loss, m) = head(Responses::Grid(&at, targets, mask))?;
        measured = Some(m);
        Ok::<_, StageError>(loss)
    })?;
    Ok(measured.expect("loss_of ran"))
}

/// What the output head reads in a training pass.
enum Responses<'a> {
    /// States at the response positions `[B, R, d]`, the tokens and the mask `[B, R]`.
    Grid(&'a Tensor, Tensor, Tensor),
    /// Packed rows' states `[1, T, d]`.
    Packed(&'a Tensor, &'a Flat),
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
    crate::data::columns::strings(batch, column, stage)?
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

    /// A prompt two rows share is packed once: a row of its own, and each
    /// response's row attends to it as context; a prompt of one row packs
    /// with its response; each response token is read where it is predicted.
    #[test]
    fn a_shared_prompt_packs_once() {
        let prompts = vec![vec![1i64, 2], vec![1, 2], vec![3]];
        let responses = vec![vec![4i64], vec![5, 6], vec![]];
        let flat = pack_flat(&prompts, &responses, 0, tch::Device::Cpu);
        assert_eq!(
            Vec::<i64>::try_from(flat.ids.view([-1])).unwrap(),
            [1, 2, 4, 5, 6, 3]
        );
        let row = |keys: Vec<i64>, context| AttentionRow { keys, context };
        assert_eq!(
            flat.layout,
            PackedLayout {
                positions: vec![0, 1, 2, 2, 3, 0],
                rows: vec![
                    row(vec![0, 1], 0),
                    row(vec![0, 1, 2], 2),
                    row(vec![0, 1, 3, 4], 2),
                    row(vec![5], 0),
                ],
            }
        );
        flat.layout.check().unwrap();
        assert_eq!(
            Vec::<i64>::try_from(flat.index.view([-1])).unwrap(),
            [1, 1, 1, 3, 5, 5]
        );
        assert_eq!(
            Vec::<i64>::try_from(flat.targets.view([-1])).unwrap(),
            [4, 0, 5, 6, 0, 0]
        );
    }

    #[test]
    fn chunked_and_packed_passes_give_the_same_log_probs() {
        // float64: the libtorch path (the CPU kernels take float32 only).
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/tiny-llama");
        let model = Model::load(&dir, weir_gpu::Device::Cpu, tch::Kind::Double).unwrap();
        let prompts = vec![vec![1i64, 2], vec![1, 2], vec![3, 4, 5]];
        let responses = vec![vec![5i64, 6, 7], vec![8], vec![9, 10]];
        let (whole, mask) = response_logprobs(&model, &prompts, &responses, 0.7, 0, false).unwrap();
        // Chunked, packed (a shared prompt once, the head at real positions only), both.
        for (chunk, packed) in [(1, false), (2, false), (4, false), (0, true), (2, true)] {
            let (other, m) =
                response_logprobs(&model, &prompts, &responses, 0.7, chunk, packed).unwrap();
            assert_eq!(m, mask);
            let d = ((&other - &whole) * &mask).abs().max().double_value(&[]);
            assert!(d < 1e-12, "chunk {chunk}, packed {packed}: {d:e}");
        }
        // A token outside the vocabulary is named before anything runs
        // (on the host: no device is asked to check).
        let vocab = model.config.vocab_size;
        for bad in [vocab, -1] {
            let rows = vec![vec![1i64, bad]];
            let err = response_logprobs(&model, &prompts[..1], &rows, 1.0, 0, false)
                .err()
                .unwrap()
                .to_string();
            assert!(
                err.contains(&format!("token id {bad}")) && err.contains("tiny-llama"),
                "{err}"
            );
        }
    }

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
