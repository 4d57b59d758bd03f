//! The decoder of every family (Llama, Mistral, Qwen2, Qwen3) on the CPU in
//! float32, without libtorch in the loop: `CpuModel`, the packed weights,
//! and its forward pass over rows of (cache slot, position).
//!
//! A forward pass over `m` rows is 4 packed matrix products per layer (fused
//! q/k/v, o with the residual added in place, fused gate/up, down with the
//! residual) plus the LM head; RMSNorm, RoPE, the q/k norms, attention over
//! the cache and the gated SiLU are AVX2 loops over the rows.

use rayon::prelude::*;

use super::gemm::{self, Packed};
use super::math;
use super::state::{Cache, RopeTables, Row, Scratch, Shape};
use crate::config::ModelConfig;
use crate::error::ModelError;

thread_local! {
    /// Attention scores of one head, per kernel thread.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A model's weights, packed for the CPU kernels.
#[derive(Debug)]
pub struct CpuModel {
    /// Its sizes.
    pub(super) shape: Shape,
    eps: f32,
    /// The token embeddings; `None` when tied to the head, whose packed
    /// panels then give each token's row (one copy of the matrix, not two).
    embed: Option<Vec<f32>>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Packed,
}

#[derive(Debug)]
struct Layer {
    input_norm: Vec<f32>,
    qkv: Packed,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    o: Packed,
    post_norm: Vec<f32>,
    gate_up: Packed,
    down: Packed,
}

impl CpuModel {
    /// The sizes a call's cache and activations are laid out by.
    pub(super) fn shape(&self) -> Shape {
        self.shape
    }

    /// Packs the weights of a causal LM of config `c`, each read by `get`
    /// from its checkpoint name as float32 values.
    pub(super) fn pack(
        c: &ModelConfig,
        get: &dyn Fn(&str) -> Result<Vec<f32>, ModelError>,
    ) -> Result<Self, ModelError> {
        let optional = |name: &str, present: bool| present.then(|| get(name)).transpose();
        let (hidden, heads, kv_heads, head_dim) = (
            c.hidden_size as usize,
            c.num_attention_heads as usize,
            c.num_key_value_heads as usize,
            c.head_dim as usize,
        );
        let intermediate = c.intermediate_size as usize;
        let vocab = c.vocab_size as usize;
        let mut layers = Vec::with_capacity(c.num_hidden_layers as usize);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}.");
            let attn = |w: &str| format!("{p}self_attn.{w}");
            let mut qkv = get(&attn("q_proj.weight"))?;
            qkv.extend(get(&attn("k_proj.weight"))?);
            qkv.extend(get(&attn("v_proj.weight"))?);
            let qkv_bias = if c.attention_bias {
                let mut b = get(&attn("q_proj.bias"))?;
                b.extend(get(&attn("k_proj.bias"))?);
                b.extend(get(&attn("v_proj.bias"))?);
                Some(b)
            } else {
                None
            };
            let mut gate_up = get(&format!("{p}mlp.gate_proj.weight"))?;
            gate_up.extend(get(&format!("{p}mlp.up_proj.weight"))?);
            let gate_up_bias = if c.mlp_bias {
                let mut b = get(&format!("{p}mlp.gate_proj.bias"))?;
                b.extend(get(&format!("{p}mlp.up_proj.bias"))?);
                Some(b)
            } else {
                None
            };
            let qkv_rows = (heads + 2 * kv_heads) * head_dim;
            layers.push(Layer {
                input_norm: get(&format!("{p}input_layernorm.weight"))?,
                qkv: Packed::new(&qkv, qkv_rows, hidden, qkv_bias),
                q_norm: optional(&attn("q_norm.weight"), c.qk_norm)?,
                k_norm: optional(&attn("k_norm.weight"), c.qk_norm)?,
                o: Packed::new(
                    &get(&attn("o_proj.weight"))?,
                    hidden,
                    heads * head_dim,
                    optional(&attn("o_proj.bias"), c.o_bias)?,
                ),
                post_norm: get(&format!("{p}post_attention_layernorm.weight"))?,
                gate_up: Packed::new(&gate_up, 2 * intermediate, hidden, gate_up_bias),
                down: Packed::new(
                    &get(&format!("{p}mlp.down_proj.weight"))?,
                    hidden,
                    intermediate,
                    optional(&format!("{p}mlp.down_proj.bias"), c.mlp_bias)?,
                ),
            });
        }
        let embed = get("model.embed_tokens.weight")?;
        let (lm_head, embed) = if c.tie_word_embeddings {
            (Packed::new(&embed, vocab, hidden, None), None)
        } else {
            let head = get("lm_head.weight")?;
            (Packed::new(&head, vocab, hidden, None), Some(embed))
        };
        Ok(CpuModel {
            shape: Shape {
                layers: layers.len(),
                hidden,
                heads,
                kv_heads,
                head_dim,
                intermediate,
                vocab,
            },
            eps: c.rms_norm_eps as f32,
            lm_head,
            embed,
            layers,
            norm: get("model.norm.weight")?,
        })
    }

    /// Attention of one row's query heads `q` over its sequence's cached
    /// keys and values of layer `l`, up to and including its own position.
    /// The query heads of a GQA group run together (up to four at a time),
    /// so each key and value is read once per group.
    unsafe fn attend(&self, q: &[f32], cache: &Cache, l: usize, row: Row, out: &mut [f32]) {
        let d = self.shape.head_dim;
        let group = self.shape.heads / self.shape.kv_heads;
        let scale = 1.0 / (d as f32).sqrt();
        let len = row.pos + 1;
        SCORES.with(|scores| {
            let mut scores = scores.borrow_mut();
            scores.resize(4 * len, 0.0);
            for g in 0..self.shape.kv_heads {
                let keys = cache.keys(row.slot, l, g);
                let values = cache.values(row.slot, l, g, len);
                let mut h = g * group;
                while h < (g + 1) * group {
                    let n = ((g + 1) * group - h).min(4);
                    let (q, out) = (&q[h * d..(h + n) * d], &mut out[h * d..(h + n) * d]);
                    let scores = &mut scores[..n * len];
                    let cap = cache.capacity;
                    match n {
                        4 => math::scores_transposed::<4>(q, keys, cap, scale, len, scores),
                        3 => math::scores_transposed::<3>(q, keys, cap, scale, len, scores),
                        2 => math::scores_transposed::<2>(q, keys, cap, scale, len, scores),
                        _ => math::scores_transposed::<1>(q, keys, cap, scale, len, scores),
                    }
                    for head in scores.chunks_exact_mut(len) {
                        let top = math::max(head);
                        for score in head.iter_mut() {
                            *score -= top;
                        }
                        math::exp_in_place(head);
                        let total: f32 = head.iter().sum();
                        for score in head.iter_mut() {
                            *score /= total;
                        }
                    }
                    match n {
                        4 => math::weighted_sum::<4>(scores, values, len, out),
                        3 => math::weighted_sum::<3>(scores, values, len, out),
                        2 => math::weighted_sum::<2>(scores, values, len, out),
                        _ => math::weighted_sum::<1>(scores, values, len, out),
                    }
                    h += n;
                }
            }
        });
    }

    /// RMSNorm of the first `m` rows of `x` into `out`.
    unsafe fn norm_rows(&self, x: &[f32], weight: &[f32], m: usize, out: &mut [f32]) {
        let hd = self.shape.hidden;
        for (x, out) in x[..m * hd].chunks_exact(hd).zip(out.chunks_exact_mut(hd)) {
            math::rms_norm(x, weight, self.eps, out);
        }
    }

    /// Runs the tokens `ids` at `rows` (cache slot and position) through the
    /// decoder, appending their keys and values to the cache, and returns the
    /// logits `[logit_rows.len(), vocab]` of the rows listed in `logit_rows`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn forward<'s>(
        &self,
        ids: &[i64],
        rows: &[Row],
        cache: &mut Cache,
        rope: &RopeTables,
        scratch: &'s mut Scratch,
        logit_rows: &[usize],
        pool: Option<&rayon::ThreadPool>,
    ) -> &'s [f32] {
        let m = rows.len();
        let (hd, d) = (self.shape.hidden, self.shape.head_dim);
        let (q_width, kv_width) = (self.shape.heads * d, self.shape.kv_heads * d);
        let qkv_width = q_width + 2 * kv_width;
        let s = scratch;
        s.reserve(m, self.shape(), logit_rows.len());
        for (i, &id) in ids.iter().enumerate() {
            let id = id as usize;
            let x = &mut s.x[i * hd..(i + 1) * hd];
            match &self.embed {
                Some(embed) => x.copy_from_slice(&embed[id * hd..(id + 1) * hd]),
                None => self.lm_head.row(id, x),
            }
        }
        for (l, layer) in self.layers.iter().enumerate() {
            self.norm_rows(&s.x, &layer.input_norm, m, &mut s.xn);
            gemm::matmul(&s.xn, hd, m, &layer.qkv, &mut s.qkv, qkv_width, false, pool);
            for (i, row) in rows.iter().enumerate() {
                let qkv = &mut s.qkv[i * qkv_width..(i + 1) * qkv_width];
                let (q, kv) = qkv.split_at_mut(q_width);
                let (k, v) = kv.split_at_mut(kv_width);
                let (cos, sin) = rope.at(row.pos);
                for head in q.chunks_exact_mut(d) {
                    if let Some(w) = &layer.q_norm {
                        s.head.copy_from_slice(head);
                        math::rms_norm(&s.head, w, self.eps, head);
                    }
                    rotate(head, cos, sin);
                }
                for (h, head) in k.chunks_exact_mut(d).enumerate() {
                    if let Some(w) = &layer.k_norm {
                        s.head.copy_from_slice(head);
                        math::rms_norm(&s.head, w, self.eps, head);
                    }
                    rotate(head, cos, sin);
                    cache.put(row.slot, l, h, row.pos, head, &v[h * d..(h + 1) * d]);
                }
            }
            let att = &mut s.att[..m * q_width];
            let qkv = &s.qkv[..m * qkv_width];
            let cache = &*cache;
            let attend = |(i, (out, row)): (usize, (&mut [f32], &Row))| {
                self.attend(
                    &qkv[i * qkv_width..i * qkv_width + q_width],
                    cache,
                    l,
                    *row,
                    out,
                )
            };
            match pool {
                Some(pool) if m > 1 => pool.install(|| {
                    att.par_chunks_mut(q_width)
                        .zip(rows.par_iter())
                        .enumerate()
                        .for_each(attend)
                }),
                _ => att
                    .chunks_mut(q_width)
                    .zip(rows)
                    .enumerate()
                    .for_each(attend),
            }
            gemm::matmul(&s.att, q_width, m, &layer.o, &mut s.x, hd, true, pool);
            self.norm_rows(&s.x, &layer.post_norm, m, &mut s.xn);
            let (inter, gu_width) = (self.shape.intermediate, 2 * self.shape.intermediate);
            gemm::matmul(
                &s.xn,
                hd,
                m,
                &layer.gate_up,
                &mut s.gate_up,
                gu_width,
                false,
                pool,
            );
            for i in 0..m {
                math::silu_mul(
                    &s.gate_up[i * gu_width..(i + 1) * gu_width],
                    &mut s.act[i * inter..(i + 1) * inter],
                );
            }
            gemm::matmul(&s.act, inter, m, &layer.down, &mut s.x, hd, true, pool);
        }
        for (j, &i) in logit_rows.iter().enumerate() {
            math::rms_norm(
                &s.x[i * hd..(i + 1) * hd],
                &self.norm,
                self.eps,
                &mut s.xn[j * hd..(j + 1) * hd],
            );
        }
        let count = logit_rows.len();
        gemm::matmul(
            &s.xn,
            hd,
            count,
            &self.lm_head,
            &mut s.logits,
            self.shape.vocab,
            false,
            pool,
        );
        &s.logits[..count * self.shape.vocab]
    }
}

/// Rotates one head by its position's angles (transformers' `rotate_half`
/// layout: `x·cos + [−x₂, x₁]·sin`).
fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}
