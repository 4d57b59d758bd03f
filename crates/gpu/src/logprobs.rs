//! Log-probabilities and entropy from logits, and the language-model head
//! run in chunks (forward and backward).

use tch::{Kind, Tensor};

/// `log_softmax(logits / temperature)` at `targets`: `[.., V]` and `[..]` → `[..]`, in float32 or better.
pub fn gather_logprobs(logits: &Tensor, targets: &Tensor, temperature: f64) -> Tensor {
    logprobs_at(logits, &targets.unsqueeze(-1), temperature).squeeze_dim(-1)
}

/// `log_softmax(logits / temperature)` at `ids`: `[.., V]` and `[.., k]`
/// → `[.., k]` (k ids per position, e.g. a teacher's top k), in float32 or better.
pub fn logprobs_at(logits: &Tensor, ids: &Tensor, temperature: f64) -> Tensor {
    let kind = softmax_kind(logits.kind());
    let scaled = if temperature == 1.0 {
        logits.to_kind(kind)
    } else {
        logits.to_kind(kind) / temperature
    };
    scaled.log_softmax(-1, kind).gather(-1, ids, false)
}

/// Entropy of `softmax(logits / temperature)` over the last dimension.
pub fn entropy(logits: &Tensor, temperature: f64) -> Tensor {
    let kind = if logits.kind() == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    };
    let logp = (logits.to_kind(kind) / temperature).log_softmax(-1, kind);
    -(logp.exp() * &logp).sum_dim_intlist(-1, false, kind)
}

/// The float kind the log-softmax runs in: float32, or float64 for a float64 model.
fn softmax_kind(kind: Kind) -> Kind {
    if kind == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    }
}

/// What the output head is read for at each position: the log-prob of
/// the position's target, the entropy (at a temperature of its own) and the
/// log-probs of `k` more ids (`[N, k]`: a teacher's top k), as asked.
#[derive(Clone, Copy, Debug, Default)]
pub struct HeadReads<'a> {
    /// The entropy's temperature, if the entropy is read.
    pub entropy_at: Option<f64>,
    /// Ids `[N, k]` whose log-probs are read too.
    pub support: Option<&'a Tensor>,
    /// Read the `top_k` most likely ids and their log-probs (0: not read).
    pub top_k: usize,
    /// Read the top k among the ids below this one only (a student's
    /// vocabulary, where it is smaller); the log-probs stay those of the
    /// whole vocabulary's softmax. `None`: among all ids.
    pub top_below: Option<i64>,
}

/// [`head_forward_chunked`]'s outputs: log-probs `[N]`, and the entropy `[N]` and support log-probs `[N, k]` when read.
pub struct HeadOutputs {
    /// `log p(target)` at each position.
    pub logprobs: Tensor,
    /// The entropy at each position, if read.
    pub entropy: Option<Tensor>,
    /// `log p(id)` of each support id, if read.
    pub support: Option<Tensor>,
    /// The `top_k` largest log-probs `[N, k]` (descending) and their ids `[N, k]`, if read.
    pub top: Option<(Tensor, Tensor)>,
}

/// Log-probs of `targets` `[N]` under the output head `weight`
/// `[vocab, hidden]` applied to `hidden` `[N, hidden]` at `temperature`
/// (and what `reads` asks for besides), `chunk` positions at a time: at
/// most `chunk × vocab` logits exist at once, whatever `N`. Without
/// gradients; the gradient is [`head_backward_chunked`]'s. Equal to
/// [`gather_logprobs`], [`entropy`] and [`logprobs_at`] over the full logits.
pub fn head_forward_chunked(
    weight: &Tensor,
    hidden: &Tensor,
    targets: &Tensor,
    temperature: f64,
    reads: HeadReads<'_>,
    chunk: usize,
) -> HeadOutputs {
    let _guard = tch::no_grad_guard();
    let n = hidden.size()[0];
    let step = chunk.max(1) as i64;
    let (mut logprobs, mut entropies, mut support) = (Vec::new(), Vec::new(), Vec::new());
    let (mut top_values, mut top_ids) = (Vec::new(), Vec::new());
    for start in (0..n).step_by(step as usize) {
        let len = step.min(n - start);
        let logits = hidden.narrow(0, start, len).matmul(&weight.tr());
        let t = targets.narrow(0, start, len);
        logprobs.push(gather_logprobs(&logits, &t, temperature));
        if let Some(at) = reads.entropy_at {
            entropies.push(entropy(&logits, at));
        }
        if let Some(ids) = reads.support {
            support.push(logprobs_at(
                &logits,
                &ids.narrow(0, start, len),
                temperature,
            ));
        }
        if reads.top_k > 0 {
            let (values, ids) = top_logprobs(&logits, reads.top_k, temperature, reads.top_below);
            top_values.push(values);
            top_ids.push(ids);
        }
    }
    HeadOutputs {
        logprobs: Tensor::cat(&logprobs, 0),
        entropy: reads.entropy_at.map(|_| Tensor::cat(&entropies, 0)),
        support: reads.support.map(|_| Tensor::cat(&support, 0)),
        top: (reads.top_k > 0).then(|| (Tensor::cat(&top_values, 0), Tensor::cat(&top_ids, 0))),
    }
}

/// The `k` largest of `log_softmax(logits / temperature)` `[.., k]`,
/// descending, and their ids `[.., k]`, among the ids below `below` (all:
/// `None`; `k` at most the ids it leaves).
pub fn top_logprobs(
    logits: &Tensor,
    k: usize,
    temperature: f64,
    below: Option<i64>,
) -> (Tensor, Tensor) {
    let kind = softmax_kind(logits.kind());
    let vocab = logits.size().last().copied().unwrap_or(0);
    let among = below.map_or(vocab, |b| b.clamp(1, vocab.max(1)));
    let logp = (logits.to_kind(kind) / temperature).log_softmax(-1, kind);
    logp.narrow(-1, 0, among)
        .topk((k as i64).min(among), -1, true, true)
}

/// The gradient of a loss in what [`head_forward_chunked`] read: in the
/// log-probs `[N]`, in the entropy `[N]` (with the temperature it was read
/// at) and in the support log-probs `[N, k]` (with their ids).
#[derive(Clone, Copy, Debug)]
pub struct HeadGrads<'a> {
    /// `∂L/∂ log p(target)`.
    pub logprobs: &'a Tensor,
    /// `∂L/∂H` and the entropy's temperature.
    pub entropy: Option<(&'a Tensor, f64)>,
    /// The support ids `[N, k]` and `∂L/∂ log p(id)`.
    pub support: Option<(&'a Tensor, &'a Tensor)>,
}

/// The gradient of a loss in `hidden` `[N, hidden]` and in the head's
/// `weight` `[vocab, hidden]`, given its gradient in what
/// [`head_forward_chunked`] read (`grads`), recomputing the logits `chunk`
/// positions at a time. With logits `x = h·Wᵀ`, `z = x/τ`, `p =
/// softmax(z)`, and `g_i` the gradient in `log p_i` of each id read (the
/// target, each support id): `∂/∂z = Σ_i g_i · (onehot(i) − p)`, `∂/∂x =
/// ∂/∂z / τ`; for the entropy at `τ_H` with `q = softmax(x/τ_H)`: `− g_H ·
/// q ⊙ (log q + H) / τ_H`; then `∂/∂h = ∂/∂x · W` and `∂/∂W = (∂/∂x)ᵀ · h`.
pub fn head_backward_chunked(
    weight: &Tensor,
    hidden: &Tensor,
    targets: &Tensor,
    temperature: f64,
    grads: HeadGrads<'_>,
    chunk: usize,
) -> (Tensor, Tensor) {
    let _guard = tch::no_grad_guard();
    let n = hidden.size()[0];
    let step = chunk.max(1) as i64;
    let kind = softmax_kind(hidden.kind());
    let mut grad_weight = weight.zeros_like();
    let mut grad_hidden = Vec::new();
    for start in (0..n).step_by(step as usize) {
        let len = step.min(n - start);
        let h = hidden.narrow(0, start, len);
        let x = h.matmul(&weight.tr()).to_kind(kind);
        let logp = (&x / temperature).log_softmax(-1, kind);
        let p = logp.exp();
        let g = grads
            .logprobs
            .narrow(0, start, len)
            .to_kind(kind)
            .unsqueeze(-1);
        // Σ_i g_i onehot(i), and Σ_i g_i, over the ids read at each position
        // (new tensors: `g` may share the caller's storage).
        let mut onehots = p.zeros_like();
        let _ = onehots.scatter_add_(-1, &targets.narrow(0, start, len).unsqueeze(-1), &g);
        let g_all = match grads.support {
            Some((ids, gs)) => {
                let gs = gs.narrow(0, start, len).to_kind(kind);
                let _ = onehots.scatter_add_(-1, &ids.narrow(0, start, len), &gs);
                &g + gs.sum_dim_intlist(-1, true, kind)
            }
            None => g,
        };
        let mut dx = (onehots - &p * g_all) / temperature;
        if let Some((ge, at)) = grads.entropy {
            let ge = ge.narrow(0, start, len).to_kind(kind).unsqueeze(-1);
            let logq = if at == temperature {
                logp.shallow_clone()
            } else {
                (&x / at).log_softmax(-1, kind)
            };
            let q = logq.exp();
            let h_ent = -(&q * &logq).sum_dim_intlist(-1, true, kind);
            dx -= ge * &q * (&logq + h_ent) / at;
        }
        let dlogits = dx.to_kind(weight.kind());
        grad_hidden.push(dlogits.matmul(weight));
        grad_weight += dlogits.tr().matmul(&h);
    }
    (Tensor::cat(&grad_hidden, 0), grad_weight)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunked head with support ids (several per position, one
    /// repeated, one the target) and the entropy: its log-probs equal the
    /// full logits', and its gradients equal autograd's through them, at
    /// every chunk size.
    #[test]
    fn the_chunked_head_reads_and_differentiates_support_ids() {
        tch::manual_seed(3);
        let opts = (Kind::Double, tch::Device::Cpu);
        let (n, d, v) = (5i64, 4i64, 7i64);
        let weight = Tensor::randn([v, d], opts);
        let hidden = Tensor::randn([n, d], opts);
        let targets = Tensor::from_slice(&[1i64, 6, 0, 3, 3]);
        let ids =
            Tensor::from_slice(&[1i64, 2, 2, 6, 0, 5, 0, 1, 3, 4, 5, 6, 3, 3, 0]).view([n, 3]);
        let (g_lp, g_h, g_s) = (
            Tensor::randn([n], opts),
            Tensor::randn([n], opts),
            Tensor::randn([n, 3], opts),
        );
        let (tau, tau_h) = (0.7, 1.3);
        // Autograd through the full logits.
        let (w, h) = (
            weight.copy().set_requires_grad(true),
            hidden.copy().set_requires_grad(true),
        );
        let logits = h.matmul(&w.tr());
        let lp = gather_logprobs(&logits, &targets, tau);
        let ent = entropy(&logits, tau_h);
        let sup = logprobs_at(&logits, &ids, tau);
        let loss = (&lp * &g_lp).sum(Kind::Double)
            + (&ent * &g_h).sum(Kind::Double)
            + (&sup * &g_s).sum(Kind::Double);
        loss.backward();
        for chunk in [1, 2, 5, 9] {
            let reads = HeadReads {
                entropy_at: Some(tau_h),
                support: Some(&ids),
                top_k: 2,
                top_below: None,
            };
            let out = head_forward_chunked(&weight, &hidden, &targets, tau, reads, chunk);
            let close = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]) < 1e-12;
            assert!(close(&out.logprobs, &lp.detach()));
            assert!(close(out.entropy.as_ref().unwrap(), &ent.detach()));
            assert!(close(out.support.as_ref().unwrap(), &sup.detach()));
            let (top, top_ids) = out.top.unwrap();
            let full = (logits.detach() / tau).log_softmax(-1, Kind::Double);
            assert!(close(&top, &full.gather(-1, &top_ids, false)));
            assert!(close(&top.select(1, 0), &full.max_dim(-1, false).0));
            // The top among the first 3 ids: the whole softmax's log-probs, ids below 3.
            let below = HeadReads {
                top_below: Some(3),
                ..reads
            };
            let (top3, ids3) = head_forward_chunked(&weight, &hidden, &targets, tau, below, chunk)
                .top
                .unwrap();
            assert!(close(&top3, &full.gather(-1, &ids3, false)));
            assert!(close(
                &top3.select(1, 0),
                &full.narrow(-1, 0, 3).max_dim(-1, false).0
            ));
            assert!(ids3.max().int64_value(&[]) < 3);
            let grads = HeadGrads {
                logprobs: &g_lp,
                entropy: Some((&g_h, tau_h)),
                support: Some((&ids, &g_s)),
            };
            let (gh, gw) = head_backward_chunked(&weight, &hidden, &targets, tau, grads, chunk);
            assert!(close(&gh, &h.grad()), "chunk {chunk}: hidden");
            assert!(close(&gw, &w.grad()), "chunk {chunk}: weight");
        }
    }

    #[test]
    fn logprobs_and_entropy_by_hand() {
        let logits = Tensor::from_slice(&[0.0f32, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]).view([2, 4]);
        let targets = Tensor::from_slice(&[1i64, 0]);
        let lp = Vec::<f32>::try_from(gather_logprobs(&logits, &targets, 1.0)).unwrap();
        assert!((lp[0] - (0.25f32).ln()).abs() < 1e-6);
        let z = 2.0f32.exp() + 3.0;
        assert!((lp[1] - (2.0 - z.ln())).abs() < 1e-6);
        // Temperature 2 halves the logits.
        let lp2 = Vec::<f32>::try_from(gather_logprobs(&logits, &targets, 2.0)).unwrap();
        assert!((lp2[1] - (1.0 - (1.0f32.exp() + 3.0).ln())).abs() < 1e-6);
        let h = Vec::<f32>::try_from(entropy(&logits, 1.0)).unwrap();
        assert!((h[0] - 4.0f32.ln()).abs() < 1e-6, "uniform over 4: ln 4");
        let p: Vec<f32> = [2.0f32.exp(), 1.0, 1.0, 1.0]
            .iter()
            .map(|e| e / z)
            .collect();
        let want: f32 = -p.iter().map(|p| p * p.ln()).sum::<f32>();
        assert!((h[1] - want).abs() < 1e-6);
    }
}
