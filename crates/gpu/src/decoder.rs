//! The decoder shared by every family: embeddings, layers of RMSNorm →
//! attention (GQA, optional q/k/v biases, optional per-head q/k RMSNorm,
//! RoPE, optional KV cache) → RMSNorm → gated SiLU MLP, and the final norm.
//! Parameters live in a `VarStore` under their HuggingFace names, so they
//! load from and save to the same safetensors layout and can be trained.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::config::ModelConfig;
pub use crate::kv_cache::KvCache;
use crate::kv_cache::LayerSlot;
use crate::rope::{self, Rope};

/// What a new model's large parameters hold until their real values arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fill {
    /// Zeros: `Model::init_weights` or a partial load sets them, so a
    /// random fill would be wasted work (about half of loading a 200M
    /// model); a head a checkpoint lacks stays zero.
    Zeros,
    /// Allocated in the model's dtype and left unwritten: every parameter
    /// is then overwritten from a checkpoint (`Model::load`, which refuses
    /// a checkpoint that lacks one), so no pass over the weights' memory
    /// is spent on a fill.
    Uninit,
    /// No data at all (zero elements), on any device: for a model whose
    /// every parameter is then given data it shares (`Model::load_shared`),
    /// so that no full-size placeholder is ever allocated beside the
    /// shared weights (on a GPU, device memory it could not spare).
    Unset,
}

/// A trainable parameter `name` of shape `dims` under `vs`, filled as `fill` says.
fn param(vs: &nn::Path, name: &str, dims: &[i64], fill: Fill) -> Tensor {
    match fill {
        Fill::Zeros => vs.zeros(name, dims),
        Fill::Uninit => vs.add(name, Tensor::empty(dims, (vs.kind(), vs.device())), true),
        Fill::Unset => vs.add(name, Tensor::empty([0], (vs.kind(), vs.device())), true),
    }
}

/// A linear layer `inputs → outputs` (weight `[outputs, inputs]`), filled as `fill` says.
pub(crate) fn linear(
    vs: nn::Path,
    inputs: i64,
    outputs: i64,
    bias: bool,
    fill: Fill,
) -> nn::Linear {
    nn::Linear {
        ws: param(&vs, "weight", &[outputs, inputs], fill),
        bs: bias.then(|| param(&vs, "bias", &[outputs], fill)),
    }
}

/// A projection of a decoder layer: the checkpoint's linear layer, plus a
/// LoRA adapter once one is attached ([`crate::lora`]).
#[derive(Debug)]
pub(crate) struct Proj {
    pub(crate) base: nn::Linear,
    pub(crate) adapter: Option<crate::adapter::Adapter>,
}

impl Proj {
    fn new(vs: nn::Path, inputs: i64, outputs: i64, bias: bool, fill: Fill) -> Self {
        Proj {
            base: linear(vs, inputs, outputs, bias, fill),
            adapter: None,
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let y = self.base.forward(x);
        match &self.adapter {
            Some(adapter) => adapter.add_to(y, x),
            None => y,
        }
    }
}

/// RMSNorm with a learned scale, normalising in float32 or better (as
/// transformers does).
#[derive(Debug)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    fn new(vs: nn::Path, size: i64, eps: f64) -> Self {
        RmsNorm {
            weight: vs.ones("weight", &[size]),
            eps,
        }
    }

    /// Normalises the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        let xf = x.to_kind(Kind::Float);
        let variance = xf.pow_tensor_scalar(2).mean_dim(-1, true, xf.kind());
        let normed = &xf * (variance + self.eps).rsqrt();
        &self.weight * normed.to_kind(kind)
    }
}

#[derive(Debug)]
struct Attention {
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(vs: nn::Path, c: &ModelConfig, fill: Fill) -> Self {
        let lin = |name: &str, i: i64, o: i64, bias: bool| Proj::new(&vs / name, i, o, bias, fill);
        let (h, kv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        Attention {
            q: lin("q_proj", c.hidden_size, h * d, c.attention_bias),
            k: lin("k_proj", c.hidden_size, kv * d, c.attention_bias),
            v: lin("v_proj", c.hidden_size, kv * d, c.attention_bias),
            o: lin("o_proj", h * d, c.hidden_size, c.o_bias),
            q_norm: c
                .qk_norm
                .then(|| RmsNorm::new(&vs / "q_norm", d, c.rms_norm_eps)),
            k_norm: c
                .qk_norm
                .then(|| RmsNorm::new(&vs / "k_norm", d, c.rms_norm_eps)),
            heads: h,
            kv_heads: kv,
            head_dim: d,
        }
    }

    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Mask,
        cache: Option<LayerSlot<'_>>,
    ) -> Tensor {
        let (b, t) = (x.size()[0], x.size()[1]);
        let shape = |y: Tensor, n: i64| y.view([b, t, n, self.head_dim]);
        let mut q = shape(self.q.forward(x), self.heads);
        let mut k = shape(self.k.forward(x), self.kv_heads);
        let v = shape(self.v.forward(x), self.kv_heads).transpose(1, 2);
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(&q);
            k = kn.forward(&k);
        }
        let q = rope::apply(&q.transpose(1, 2), cos, sin);
        let k = rope::apply(&k.transpose(1, 2), cos, sin);
        let (k, v) = match cache {
            Some(cache) => cache.append(&k, &v),
            None => (k, v),
        };
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let causal = |q: &Tensor, k: &Tensor, v: &Tensor| {
            Tensor::scaled_dot_product_attention::<Tensor>(
                q,
                k,
                v,
                None,
                0.0,
                true,
                scale,
                self.kv_heads != self.heads,
            )
        };
        let y = match mask {
            // Rows packed into one sequence: each attends within itself only,
            // causally, and no position is spent on padding.
            Mask::Segments(segments) => segments.attend(&q, &k, &v, self.head_dim, causal),
            Mask::Bias(bias) if t == 1 => self.decode_attention(&q, &k, &v, Some(bias), scale),
            Mask::Causal if t == 1 => self.decode_attention(&q, &k, &v, None, scale),
            // No bias tensor: SDPA may pick a fused (flash) kernel.
            Mask::Causal => causal(&q, &k, &v),
            Mask::Bias(bias) => Tensor::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                Some(bias),
                0.0,
                false,
                scale,
                self.kv_heads != self.heads,
            ),
        };
        self.o.forward(
            &y.transpose(1, 2)
                .reshape([b, t, self.heads * self.head_dim]),
        )
    }
}

impl Attention {
    /// Attention of one new query per sequence (a decode step). The query
    /// heads that share a key/value head are stacked as rows, so each
    /// (sequence, kv head) is one small matrix product instead of one
    /// matrix-vector product per query head, and no repeated keys are built.
    fn decode_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        bias: Option<&Tensor>,
        scale: f64,
    ) -> Tensor {
        let b = q.size()[0];
        let group = self.heads / self.kv_heads;
        let q = q.reshape([b, self.kv_heads, group, self.head_dim]);
        let mut scores = q.matmul(&k.transpose(-2, -1)) * scale;
        if let Some(bias) = bias {
            scores += bias;
        }
        let probs = scores.softmax(-1, scores.kind());
        probs.matmul(v).reshape([b, self.heads, 1, self.head_dim])
    }
}

#[derive(Debug)]
struct Mlp {
    gate: Proj,
    up: Proj,
    down: Proj,
}

impl Mlp {
    fn new(vs: nn::Path, c: &ModelConfig, fill: Fill) -> Self {
        let (h, i, bias) = (c.hidden_size, c.intermediate_size, c.mlp_bias);
        Mlp {
            gate: Proj::new(&vs / "gate_proj", h, i, bias, fill),
            up: Proj::new(&vs / "up_proj", h, i, bias, fill),
            down: Proj::new(&vs / "down_proj", i, h, bias, fill),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        self.down
            .forward(&(self.gate.forward(x).silu() * self.up.forward(x)))
    }
}

#[derive(Debug)]
struct Layer {
    input_norm: RmsNorm,
    attention: Attention,
    post_norm: RmsNorm,
    mlp: Mlp,
}

/// Embeddings, decoder layers and the final norm (`model.*` in a checkpoint).
#[derive(Debug)]
pub struct Decoder {
    /// The token embedding matrix `[vocab, hidden]`.
    pub embed: Tensor,
    layers: Vec<Layer>,
    norm: RmsNorm,
    rope: Rope,
}

impl Decoder {
    /// Creates the parameters under `vs` (which should be the `model` path),
    /// the large ones filled as `fill` says.
    pub(crate) fn new(vs: nn::Path, c: &ModelConfig, fill: Fill) -> Self {
        let embed = param(
            &(&vs / "embed_tokens"),
            "weight",
            &[c.vocab_size, c.hidden_size],
            fill,
        );
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let l = &vs / "layers" / i;
                Layer {
                    input_norm: RmsNorm::new(&l / "input_layernorm", c.hidden_size, c.rms_norm_eps),
                    attention: Attention::new(&l / "self_attn", c, fill),
                    post_norm: RmsNorm::new(
                        &l / "post_attention_layernorm",
                        c.hidden_size,
                        c.rms_norm_eps,
                    ),
                    mlp: Mlp::new(&l / "mlp", c, fill),
                }
            })
            .collect();
        Decoder {
            embed,
            layers,
            norm: RmsNorm::new(&vs / "norm", c.hidden_size, c.rms_norm_eps),
            rope: Rope::new(c, vs.device()),
        }
    }

    /// The rotary position tables.
    pub(crate) fn rope(&self) -> &Rope {
        &self.rope
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Every layer's projections by module path under the decoder
    /// (`layers.{i}.self_attn.q_proj`, …, `layers.{i}.mlp.down_proj`).
    pub(crate) fn projections_mut(&mut self) -> Vec<(String, &mut Proj)> {
        let mut out = Vec::with_capacity(self.layers.len() * 7);
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let a = &mut layer.attention;
            let m = &mut layer.mlp;
            for (name, proj) in [
                ("self_attn.q_proj", &mut a.q),
                ("self_attn.k_proj", &mut a.k),
                ("self_attn.v_proj", &mut a.v),
                ("self_attn.o_proj", &mut a.o),
                ("mlp.gate_proj", &mut m.gate),
                ("mlp.up_proj", &mut m.up),
                ("mlp.down_proj", &mut m.down),
            ] {
                out.push((format!("layers.{i}.{name}"), proj));
            }
        }
        out
    }

    /// Final hidden states `[B, T, hidden]` for `input_ids` `[B, T]`.
    ///
    /// `key_mask` `[B, S]` (1 = attend) covers the cached and the new
    /// positions (S = cached + T); `None` attends to every earlier position
    /// (plain causal attention, with no bias tensor built when nothing is
    /// cached). `position_ids` `[B, T]` are the new tokens' positions. With
    /// a cache, new keys are appended to it.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        key_mask: Option<&Tensor>,
        position_ids: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Tensor {
        let past = cache.as_ref().map_or(0, |c| c.past());
        let mask = Mask::new(key_mask, input_ids, past, self.embed.kind());
        self.run(input_ids, &mask, position_ids, cache)
    }

    /// Final hidden states `[1, T, hidden]` of rows packed end to end into
    /// `input_ids` `[1, T]` as `layout` lays them out (its attention rows,
    /// each attending within itself; `position_ids` `[1, T]` its
    /// positions). The same states as each row run on its own, with no
    /// position of padding.
    pub fn forward_packed(
        &self,
        input_ids: &Tensor,
        layout: &PackedLayout,
        position_ids: &Tensor,
    ) -> Tensor {
        self.run(
            input_ids,
            &Mask::Segments(Segments::new(layout, input_ids.device())),
            position_ids,
            None,
        )
    }

    fn run(
        &self,
        input_ids: &Tensor,
        mask: &Mask,
        position_ids: &Tensor,
        mut cache: Option<&mut KvCache>,
    ) -> Tensor {
        let kind = self.embed.kind();
        let mut h = Tensor::embedding(&self.embed, input_ids, -1, false, false);
        let (cos, sin) = self.rope.tables(position_ids, kind);
        for (i, layer) in self.layers.iter().enumerate() {
            let slot = cache.as_mut().map(|c| c.layer(i));
            h = layer.forward(&h, &cos, &sin, mask, slot);
        }
        self.norm.forward(&h)
    }

    /// Gradient checkpointing: computes `loss_of(final hidden states)` for
    /// `input_ids` (no cache) and backpropagates it into the parameters'
    /// gradients, keeping only each layer's input instead of every
    /// activation. The layers first run without autograd; the loss is
    /// differentiated down to the last layer's output; then each layer, from
    /// the last, is run again from its saved input and differentiated with the
    /// gradient that reached its output. Returns the loss, detached.
    ///
    /// Gradients match a plain `forward` + `backward` up to rounding; the
    /// cost is one more forward pass of the layers.
    pub fn backward_checkpointed<E>(
        &self,
        input_ids: &Tensor,
        key_mask: Option<&Tensor>,
        position_ids: &Tensor,
        loss_of: impl FnOnce(&Tensor) -> Result<Tensor, E>,
    ) -> Result<Tensor, E> {
        let mask = Mask::new(key_mask, input_ids, 0, self.embed.kind());
        self.backward_with(input_ids, &mask, position_ids, loss_of)
    }

    /// [`Decoder::backward_checkpointed`] over rows packed end to end, as
    /// [`Decoder::forward_packed`] runs them.
    pub fn backward_checkpointed_packed<E>(
        &self,
        input_ids: &Tensor,
        layout: &PackedLayout,
        position_ids: &Tensor,
        loss_of: impl FnOnce(&Tensor) -> Result<Tensor, E>,
    ) -> Result<Tensor, E> {
        let mask = Mask::Segments(Segments::new(layout, input_ids.device()));
        self.backward_with(input_ids, &mask, position_ids, loss_of)
    }

    fn backward_with<E>(
        &self,
        input_ids: &Tensor,
        mask: &Mask,
        position_ids: &Tensor,
        loss_of: impl FnOnce(&Tensor) -> Result<Tensor, E>,
    ) -> Result<Tensor, E> {
        let kind = self.embed.kind();
        let (cos, sin) = self.rope.tables(position_ids, kind);
        let mut inputs = Vec::with_capacity(self.layers.len());
        let last = {
            let _guard = tch::no_grad_guard();
            let mut h = Tensor::embedding(&self.embed, input_ids, -1, false, false);
            for layer in &self.layers {
                inputs.push(h.shallow_clone());
                h = layer.forward(&h, &cos, &sin, mask, None);
            }
            h
        };
        let last = last.detach().set_requires_grad(true);
        let loss = loss_of(&self.norm.forward(&last))?;
        loss.backward();
        let mut grad = last.grad();
        for (layer, input) in self.layers.iter().zip(inputs).rev() {
            let x = input.detach().set_requires_grad(true);
            let y = layer.forward(&x, &cos, &sin, mask, None);
            (y * &grad).sum(kind).backward();
            grad = x.grad();
        }
        // A frozen embedding (LoRA trains adapters only) takes no gradient.
        if self.embed.requires_grad() {
            let embedded = Tensor::embedding(&self.embed, input_ids, -1, false, false);
            (embedded * grad).sum(kind).backward();
        }
        Ok(loss.detach())
    }
}

impl Layer {
    fn forward(
        &self,
        h: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Mask,
        cache: Option<LayerSlot<'_>>,
    ) -> Tensor {
        let h = h + self
            .attention
            .forward(&self.input_norm.forward(h), cos, sin, mask, cache);
        &h + self.mlp.forward(&self.post_norm.forward(&h))
    }
}

/// Which keys each query sees.
#[derive(Debug)]
enum Mask {
    /// Every key at or before the query's position, nothing cached: SDPA's
    /// `is_causal`, no bias tensor.
    Causal,
    /// An additive bias `[B, 1, T, S]` (padding, or a cache before the new positions).
    Bias(Tensor),
    /// One row of rows packed end to end: each position sees the earlier
    /// positions of its own row only.
    Segments(Segments),
}

/// Rows packed into one sequence: each token's position id, and the
/// attention rows. An attention row lists the packed positions it attends
/// over, in order; its first `context` positions are keys only (their
/// queries belong to another row), the rest are its queries. A group's
/// shared prompt is packed once, as a row of its own, and each sample's
/// response is a row whose context is that prompt: the prompt's
/// projections and MLP run once for the group.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedLayout {
    /// Each packed token's position id.
    pub positions: Vec<i64>,
    /// The attention rows; every packed position is a query of exactly one.
    pub rows: Vec<AttentionRow>,
}

/// One attention row of a [`PackedLayout`].
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionRow {
    /// The packed positions the row attends over, in sequence order.
    pub keys: Vec<i64>,
    /// How many of `keys`, from the first, are context only.
    pub context: usize,
}

impl PackedLayout {
    /// Rows of `lengths` end to end, each attending within itself, its
    /// positions from 0.
    pub fn rows(lengths: &[i64]) -> PackedLayout {
        let mut at = 0;
        let mut rows = Vec::with_capacity(lengths.len());
        for &n in lengths {
            rows.push(AttentionRow {
                keys: (at..at + n).collect(),
                context: 0,
            });
            at += n;
        }
        PackedLayout {
            positions: lengths.iter().flat_map(|&n| 0..n).collect(),
            rows,
        }
    }

    /// The packed sequence's length.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether nothing is packed.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Checks that every packed position is the query of exactly one row
    /// and that every key lies in the sequence.
    pub fn check(&self) -> Result<(), String> {
        let n = self.len();
        let mut queried = vec![false; n];
        for (r, row) in self.rows.iter().enumerate() {
            if row.context > row.keys.len() {
                return Err(format!(
                    "attention row {r}: context {} of {} keys",
                    row.context,
                    row.keys.len()
                ));
            }
            for (i, &k) in row.keys.iter().enumerate() {
                if k < 0 || k as usize >= n {
                    return Err(format!(
                        "attention row {r}: key {k} outside the {n} packed positions"
                    ));
                }
                if i >= row.context {
                    if queried[k as usize] {
                        return Err(format!(
                            "packed position {k} is a query of two attention rows"
                        ));
                    }
                    queried[k as usize] = true;
                }
            }
        }
        match queried.iter().position(|q| !q) {
            Some(k) => Err(format!(
                "packed position {k} is the query of no attention row"
            )),
            None => Ok(()),
        }
    }
}

/// A [`PackedLayout`] as attention runs it: in a few buckets of rows of
/// similar lengths, each bucket one causal SDPA call over its rows
/// right-padded to its longest (a real query never sees a padded key,
/// which all come after it; padded queries and context queries are
/// dropped), instead of one call per row.
///
/// The projections, the MLP and the norms, most of a layer's work, run on
/// the packed tokens and never on padding; only attention's query × key
/// pairs may include some (and a response row's context queries). A bucket takes the next longest row while its
/// padded pairs stay within 1.5× its rows' own plus 64² a row, so the
/// padded pairs are bounded and short rows (where a call costs more than
/// its arithmetic) share one call.
#[derive(Debug)]
struct Segments {
    buckets: Vec<Bucket>,
    /// Each packed position's place among the buckets' real slots laid end to end.
    order: Tensor,
}

/// Rows sharing one attention call.
#[derive(Debug)]
struct Bucket {
    rows: i64,
    width: i64,
    /// `[rows · width]`: the packed position of each slot (a padding slot
    /// repeats its row's last).
    gather: Tensor,
    /// The real slots, in row order.
    real: Tensor,
}

/// How much wider than its rows' own attention pairs a bucket may grow
/// (and the slack each row adds, in pairs).
const BUCKET_WASTE: f64 = 1.5;
const BUCKET_SLACK_PAIRS: f64 = 64.0 * 64.0;

impl Segments {
    fn new(layout: &PackedLayout, device: tch::Device) -> Segments {
        let width = |r: usize| layout.rows[r].keys.len() as i64;
        let mut by_length: Vec<usize> = (0..layout.rows.len())
            .filter(|&r| layout.rows[r].keys.len() > layout.rows[r].context)
            .collect();
        by_length.sort_by_key(|&r| std::cmp::Reverse(width(r)));
        let mut buckets = Vec::new();
        let mut place = vec![0i64; layout.len()];
        let mut placed = 0i64;
        let mut i = 0;
        while i < by_length.len() {
            let widest = width(by_length[i]);
            let mut own = (widest * widest) as f64;
            let mut j = i + 1;
            while j < by_length.len() {
                let n = width(by_length[j]);
                let rows = (j - i + 1) as f64;
                let padded = rows * (widest * widest) as f64;
                if padded > BUCKET_WASTE * (own + (n * n) as f64) + BUCKET_SLACK_PAIRS * rows {
                    break;
                }
                own += (n * n) as f64;
                j += 1;
            }
            let (mut gather, mut real) = (Vec::new(), Vec::new());
            for (r, &row) in by_length[i..j].iter().enumerate() {
                let AttentionRow { keys, context } = &layout.rows[row];
                let last = *keys.last().unwrap_or(&0);
                for s in 0..widest as usize {
                    gather.push(keys.get(s).copied().unwrap_or(last));
                    if s >= *context && s < keys.len() {
                        real.push(r as i64 * widest + s as i64);
                        place[keys[s] as usize] = placed;
                        placed += 1;
                    }
                }
            }
            buckets.push(Bucket {
                rows: (j - i) as i64,
                width: widest,
                gather: Tensor::from_slice(&gather).to_device(device),
                real: Tensor::from_slice(&real).to_device(device),
            });
            i = j;
        }
        Segments {
            buckets,
            order: Tensor::from_slice(&place).to_device(device),
        }
    }

    /// Attention of packed `q` `[1, H, T, d]`, `k` and `v` `[1, KV, T, d]`
    /// (`causal` runs one SDPA call), each row within itself.
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        head_dim: i64,
        causal: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
    ) -> Tensor {
        let outs: Vec<Tensor> = self
            .buckets
            .iter()
            .map(|b| {
                // [1, heads, T, d] → [rows, heads, width, d]
                let take = |x: &Tensor| {
                    let heads = x.size()[1];
                    x.index_select(2, &b.gather)
                        .view([heads, b.rows, b.width, head_dim])
                        .transpose(0, 1)
                };
                let y = causal(&take(q), &take(k), &take(v));
                let heads = y.size()[1];
                y.transpose(0, 1)
                    .reshape([1, heads, b.rows * b.width, head_dim])
                    .index_select(2, &b.real)
            })
            .collect();
        let all = if outs.len() == 1 {
            outs.into_iter().next().unwrap_or_else(|| unreachable!())
        } else {
            Tensor::cat(&outs, 2)
        };
        all.index_select(2, &self.order)
    }
}

impl Mask {
    fn new(key_mask: Option<&Tensor>, input_ids: &Tensor, past: i64, kind: Kind) -> Mask {
        let t = input_ids.size()[1];
        match key_mask {
            Some(key_mask) => Mask::Bias(attention_bias(key_mask, t, past, kind)),
            None if past == 0 => Mask::Causal,
            None => {
                let all = Tensor::ones(
                    [input_ids.size()[0], past + t],
                    (Kind::Int64, input_ids.device()),
                );
                Mask::Bias(attention_bias(&all, t, past, kind))
            }
        }
    }
}

/// The additive attention bias `[B, 1, T, S]`: 0 where query t (at absolute
/// position `past + t`) may see key s (causal and not padding), a large
/// negative number elsewhere. Finite, so fully masked (padding) rows stay
/// finite instead of NaN.
fn attention_bias(key_mask: &Tensor, t: i64, past: i64, kind: Kind) -> Tensor {
    let device = key_mask.device();
    let s = key_mask.size()[1];
    let q_pos = Tensor::arange_start(past, past + t, (Kind::Int64, device)).view([t, 1]);
    let k_pos = Tensor::arange(s, (Kind::Int64, device)).view([1, s]);
    let causal = k_pos.le_tensor(&q_pos).view([1, 1, t, s]);
    let keep = causal.logical_and(&key_mask.to_kind(Kind::Bool).view([-1, 1, 1, s]));
    let neg = match kind {
        Kind::Half => -6.0e4,
        _ => -1.0e30,
    };
    Tensor::zeros([1], (kind, device)).where_self(&keep, &Tensor::full([1], neg, (kind, device)))
}
