//! The decoder of every family (Llama, Mistral, Qwen2, Qwen3) for generation
//! and no-grad response log-probs on the CPU in float32, without libtorch in
//! the loop.
//!
//! A decode step for `m` live sequences is 4 packed matrix products per
//! layer (fused q/k/v, o with the residual added in place, fused gate/up,
//! down with the residual) plus the LM head; RMSNorm, RoPE, the q/k norms,
//! attention over the cache and the gated SiLU are AVX2 loops over the
//! rows. Each sequence has its own cache slot of `prompt + max_new` positions
//! and no padding: each distinct prompt is prefilled once and its keys and
//! values are copied to the slots of the other rows that share it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tch::{Kind, Tensor};

use rayon::prelude::*;

use super::gemm::{self, Packed};
use super::math;
use super::sample::{self, Picker};
use crate::generate::{Generation, SamplingParams, Stream};
use crate::{Model, ModelError};

thread_local! {
    /// Attention scores of one head, per kernel thread.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Prompt tokens run through the model at once during prefill.
const PREFILL_ROWS: usize = 256;

/// The packed weights of one [`Model`], kept between calls while its
/// parameters are unchanged, and a KV-cache buffer to reuse.
///
/// "Unchanged" is judged by each parameter's storage address and libtorch's
/// version counter, which every in-place write bumps (loading, applying a
/// snapshot, an optimizer step), so a stale packing is never used. A model
/// whose weights change between every two calls (a generator fed a new
/// version each step, a learner) would never reuse its packing, so after the
/// first such change the packing is dropped when its call ends instead of
/// being held as a second copy of the weights; once two calls in a row see
/// the same weights, it is kept again.
#[derive(Debug, Default)]
pub struct Prepared {
    packed: Mutex<Option<Packing>>,
    cache: Mutex<Vec<f32>>,
    pool: Mutex<Option<Arc<rayon::ThreadPool>>>,
}

/// The weights a packing was made from, the packing if it is kept, and
/// whether a second call used it.
#[derive(Debug)]
struct Packing {
    stamp: Stamp,
    packed: Option<Arc<CpuModel>>,
    reused: bool,
}

/// KV-cache buffers up to this many floats (256 MiB) are kept for the next call.
const KEPT_CACHE_FLOATS: usize = 64 << 20;

impl Prepared {
    fn model(&self, model: &Model) -> Result<Arc<CpuModel>, ModelError> {
        let stamp: Stamp = model
            .named_tensors()
            .iter()
            .map(|(_, t)| (t.data_ptr() as usize, t.internal_version()))
            .collect();
        let mut slot = self.packed.lock().unwrap_or_else(|e| e.into_inner());
        let (keep, reused) = match slot.as_mut() {
            Some(entry) if entry.stamp == stamp => {
                if let Some(packed) = &entry.packed {
                    entry.reused = true;
                    return Ok(packed.clone());
                }
                // The same weights as last call, which dropped its packing: keep it now.
                (true, true)
            }
            // New weights: keep their packing only if the last one was used twice.
            Some(entry) => (entry.reused, false),
            None => (true, false),
        };
        *slot = None; // free a stale packing before building the new one
        let packed = Arc::new(CpuModel::from_model(model)?);
        *slot = Some(Packing {
            stamp,
            packed: keep.then(|| packed.clone()),
            reused,
        });
        Ok(packed)
    }

    /// A pool of libtorch's intra-op thread count (`None` for one thread),
    /// so `set_threads` governs the kernels too.
    fn pool(&self) -> Result<Option<Arc<rayon::ThreadPool>>, ModelError> {
        let threads = tch::get_num_threads().max(1) as usize;
        if threads == 1 {
            return Ok(None);
        }
        let mut slot = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pool) = slot.as_ref().filter(|p| p.current_num_threads() == threads) {
            return Ok(Some(pool.clone()));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("weir-cpu-{i}"))
            .build()
            .map_err(|e| {
                ModelError::Input(format!("cannot start {threads} kernel threads: {e}"))
            })?;
        let pool = Arc::new(pool);
        *slot = Some(pool.clone());
        Ok(Some(pool))
    }

    /// The KV-cache buffer of an earlier call (empty when another call holds it).
    fn take_cache(&self) -> Vec<f32> {
        std::mem::take(&mut *self.cache.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Keeps `buffer` for the next call if it is small enough.
    fn give_back_cache(&self, buffer: Vec<f32>) {
        if buffer.len() <= KEPT_CACHE_FLOATS {
            *self.cache.lock().unwrap_or_else(|e| e.into_inner()) = buffer;
        }
    }
}

/// Storage address and version of every parameter.
type Stamp = Vec<(usize, i64)>;

/// A model's weights, packed for the CPU kernels.
#[derive(Debug)]
pub struct CpuModel {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    vocab: usize,
    eps: f32,
    embed: Vec<f32>,
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
    /// Copies and packs the weights of a causal LM.
    pub fn from_model(model: &Model) -> Result<Self, ModelError> {
        let c = &model.config;
        let tensors: HashMap<String, Tensor> = model.named_tensors().into_iter().collect();
        let get = |name: &str| -> Result<Vec<f32>, ModelError> {
            let t = tensors
                .get(name)
                .ok_or_else(|| ModelError::Input(format!("the model has no tensor `{name}`")))?;
            Vec::<f32>::try_from(&t.detach().to_kind(Kind::Float).contiguous().view(-1))
                .map_err(|e| ModelError::Torch(e.to_string()))
        };
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
        let head = if c.tie_word_embeddings {
            embed.clone()
        } else {
            get("lm_head.weight")?
        };
        Ok(CpuModel {
            hidden,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            vocab,
            eps: c.rms_norm_eps as f32,
            lm_head: Packed::new(&head, vocab, hidden, None),
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
        let d = self.head_dim;
        let group = self.heads / self.kv_heads;
        let scale = 1.0 / (d as f32).sqrt();
        let len = row.pos + 1;
        SCORES.with(|scores| {
            let mut scores = scores.borrow_mut();
            scores.resize(4 * len, 0.0);
            for g in 0..self.kv_heads {
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

    /// Runs the tokens `ids` at `rows` (cache slot and position) through the
    /// decoder, appending their keys and values to the cache, and returns the
    /// logits `[logit_rows.len(), vocab]` of the rows listed in `logit_rows`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[allow(clippy::too_many_arguments)]
    unsafe fn forward<'s>(
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
        let (hd, d) = (self.hidden, self.head_dim);
        let (q_width, kv_width) = (self.heads * d, self.kv_heads * d);
        let qkv_width = q_width + 2 * kv_width;
        let s = scratch;
        s.reserve(m, self, logit_rows.len());
        for (i, &id) in ids.iter().enumerate() {
            let id = id as usize;
            s.x[i * hd..(i + 1) * hd].copy_from_slice(&self.embed[id * hd..(id + 1) * hd]);
        }
        for (l, layer) in self.layers.iter().enumerate() {
            for i in 0..m {
                let span = i * hd..(i + 1) * hd;
                math::rms_norm(
                    &s.x[span.clone()],
                    &layer.input_norm,
                    self.eps,
                    &mut s.xn[span],
                );
            }
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
            for i in 0..m {
                let span = i * hd..(i + 1) * hd;
                math::rms_norm(
                    &s.x[span.clone()],
                    &layer.post_norm,
                    self.eps,
                    &mut s.xn[span],
                );
            }
            let (inter, gu_width) = (self.intermediate, 2 * self.intermediate);
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
            self.vocab,
            false,
            pool,
        );
        &s.logits[..count * self.vocab]
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

/// A token's cache slot (its sequence) and position.
#[derive(Clone, Copy, Debug)]
struct Row {
    slot: usize,
    pos: usize,
}

/// cos and sin of every position up to the longest sequence, `[len, head_dim]`.
struct RopeTables {
    cos: Vec<f32>,
    sin: Vec<f32>,
    dim: usize,
}

impl RopeTables {
    fn new(model: &Model, len: usize) -> Result<Self, ModelError> {
        let positions = Tensor::arange(len as i64, (Kind::Int64, tch::Device::Cpu)).view([1, -1]);
        let (cos, sin) = model.rope().tables(&positions, Kind::Float);
        let flat = |t: Tensor| {
            Vec::<f32>::try_from(&t.contiguous().view(-1))
                .map_err(|e| ModelError::Torch(e.to_string()))
        };
        Ok(RopeTables {
            cos: flat(cos)?,
            sin: flat(sin)?,
            dim: model.config.head_dim as usize,
        })
    }

    fn at(&self, pos: usize) -> (&[f32], &[f32]) {
        let span = pos * self.dim..(pos + 1) * self.dim;
        (&self.cos[span.clone()], &self.sin[span])
    }
}

/// Keys and values of every sequence, slot-major: per (slot, layer, k|v, kv
/// head) a block of `capacity × head_dim` floats. Keys are stored
/// transposed (`[head_dim][position]`), so the scores of consecutive
/// positions are one vector product; values by position
/// (`[position][head_dim]`).
struct Cache {
    data: Vec<f32>,
    layers: usize,
    kv_heads: usize,
    capacity: usize,
    dim: usize,
}

impl Cache {
    /// A cache in `data` (resized; every position is written before it is read).
    fn new(mut data: Vec<f32>, slots: usize, model: &CpuModel, capacity: usize) -> Self {
        let layers = model.layers.len();
        data.resize(
            slots * layers * 2 * model.kv_heads * capacity * model.head_dim,
            0.0,
        );
        Cache {
            data,
            layers,
            kv_heads: model.kv_heads,
            capacity,
            dim: model.head_dim,
        }
    }

    /// Start of the block of (slot, layer, keys (0) or values (1), head).
    fn block(&self, slot: usize, layer: usize, which: usize, head: usize) -> usize {
        (((slot * self.layers + layer) * 2 + which) * self.kv_heads + head)
            * self.capacity
            * self.dim
    }

    /// Stores the key and value of `head` at `pos`.
    fn put(
        &mut self,
        slot: usize,
        layer: usize,
        head: usize,
        pos: usize,
        key: &[f32],
        value: &[f32],
    ) {
        let (keys, cap) = (self.block(slot, layer, 0, head), self.capacity);
        for (c, &k) in key.iter().enumerate() {
            self.data[keys + c * cap + pos] = k;
        }
        let values = self.block(slot, layer, 1, head) + pos * self.dim;
        self.data[values..values + self.dim].copy_from_slice(value);
    }

    /// The transposed key block of `head` (`[head_dim][capacity]`).
    fn keys(&self, slot: usize, layer: usize, head: usize) -> &[f32] {
        let start = self.block(slot, layer, 0, head);
        &self.data[start..start + self.capacity * self.dim]
    }

    /// The values of `head` at positions `0..len` (`[len][head_dim]`).
    fn values(&self, slot: usize, layer: usize, head: usize, len: usize) -> &[f32] {
        let start = self.block(slot, layer, 1, head);
        &self.data[start..start + len * self.dim]
    }

    /// Copies the first `len` positions of slot `from` into slot `to`.
    fn copy_prefix(&mut self, from: usize, to: usize, len: usize) {
        let (cap, d) = (self.capacity, self.dim);
        for layer in 0..self.layers {
            for head in 0..self.kv_heads {
                let (src, dst) = (
                    self.block(from, layer, 0, head),
                    self.block(to, layer, 0, head),
                );
                for c in 0..d {
                    self.data
                        .copy_within(src + c * cap..src + c * cap + len, dst + c * cap);
                }
                let (src, dst) = (
                    self.block(from, layer, 1, head),
                    self.block(to, layer, 1, head),
                );
                self.data.copy_within(src..src + len * d, dst);
            }
        }
    }
}

/// Activations of one forward call, reused across calls.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    logits: Vec<f32>,
    head: Vec<f32>,
}

impl Scratch {
    fn reserve(&mut self, m: usize, model: &CpuModel, logit_rows: usize) {
        let d = model.head_dim;
        let grow = |v: &mut Vec<f32>, len: usize| {
            if v.len() < len {
                v.resize(len, 0.0);
            }
        };
        grow(&mut self.x, m * model.hidden);
        grow(&mut self.xn, m * model.hidden);
        grow(&mut self.qkv, m * (model.heads + 2 * model.kv_heads) * d);
        grow(&mut self.att, m * model.heads * d);
        grow(&mut self.gate_up, m * 2 * model.intermediate);
        grow(&mut self.act, m * model.intermediate);
        grow(&mut self.logits, logit_rows * model.vocab);
        self.head.resize(d, 0.0);
    }
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
    let mut out: Vec<Generation> = (0..prompts.len())
        .flat_map(|p| (0..n).map(move |s| Generation::empty(p, s)))
        .collect();
    let prepared = model.prepared_for_cpu();
    let cpu = prepared.model(model)?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let capacity = longest + params.max_new_tokens;
    let rope = RopeTables::new(model, capacity)?;
    let mut cache = Cache::new(prepared.take_cache(), prompts.len() * n, &cpu, capacity);
    let mut scratch = Scratch::default();
    let pool = prepared.pool()?;
    let pool = pool.as_deref();
    // SAFETY (all calls below): the caller checked that the CPU has AVX2 and FMA.
    let owner = owners(prompts);
    let first = unsafe {
        prefill(
            &cpu,
            prompts,
            &owner,
            n,
            &mut cache,
            &rope,
            &mut scratch,
            pool,
        )
    };
    let mut streams: Vec<Stream> = (0..out.len())
        .map(|r| Stream::new(params.seed, stream_ids[r / n], (r % n) as u64))
        .collect();
    let mut picker = Picker::default();
    let mut row_logits = Vec::with_capacity(cpu.vocab);
    // Live sequences: (output row = cache slot, last token, its position).
    let mut live: Vec<(usize, i64, usize)> = Vec::with_capacity(out.len());
    for (r, generation) in out.iter_mut().enumerate() {
        let (p, source) = (r / n, owner[r / n]);
        row_logits.clear();
        row_logits.extend_from_slice(&first[source * cpu.vocab..(source + 1) * cpu.vocab]);
        let (token, logprob) =
            unsafe { picker.pick(&mut row_logits, params, streams[r].next_f32()) };
        if generation.record(token, logprob, params) {
            live.push((r, token, prompts[p].len()));
        }
    }
    let mut ids = Vec::with_capacity(out.len());
    let mut rows = Vec::with_capacity(out.len());
    let mut all: Vec<usize> = Vec::with_capacity(out.len());
    while !live.is_empty() {
        ids.clear();
        rows.clear();
        for &(slot, token, pos) in &live {
            ids.push(token);
            rows.push(Row { slot, pos });
        }
        all.clear();
        all.extend(0..live.len());
        let logits =
            unsafe { cpu.forward(&ids, &rows, &mut cache, &rope, &mut scratch, &all, pool) };
        let mut kept = 0;
        for i in 0..live.len() {
            let (r, _, pos) = live[i];
            row_logits.clear();
            row_logits.extend_from_slice(&logits[i * cpu.vocab..(i + 1) * cpu.vocab]);
            let (token, logprob) =
                unsafe { picker.pick(&mut row_logits, params, streams[r].next_f32()) };
            if out[r].record(token, logprob, params) {
                live[kept] = (r, token, pos + 1);
                kept += 1;
            }
        }
        live.truncate(kept);
    }
    prepared.give_back_cache(cache.data);
    Ok(out)
}

/// For each prompt, the index of the first prompt equal to it: equal prompts
/// (the samples of one prompt, or a batch that repeats prompts itself) are
/// prefilled once.
fn owners(prompts: &[Vec<i64>]) -> Vec<usize> {
    let mut seen: HashMap<&[i64], usize> = HashMap::new();
    prompts
        .iter()
        .enumerate()
        .map(|(p, prompt)| *seen.entry(prompt.as_slice()).or_insert(p))
        .collect()
}

/// Runs each prompt `p` with `owner[p] == p` (the first of equal prompts)
/// into the slot of its first sample, then copies its keys and values to the
/// slots of every sample of every prompt equal to it; returns the logits
/// after each such prompt's last token, `[prompts, vocab]` (other rows are
/// left at 0).
#[allow(clippy::too_many_arguments)]
unsafe fn prefill(
    cpu: &CpuModel,
    prompts: &[Vec<i64>],
    owner: &[usize],
    n: usize,
    cache: &mut Cache,
    rope: &RopeTables,
    scratch: &mut Scratch,
    pool: Option<&rayon::ThreadPool>,
) -> Vec<f32> {
    let mut first = vec![0.0f32; prompts.len() * cpu.vocab];
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
        let logits = cpu.forward(&ids, &rows, cache, rope, scratch, &last, pool);
        for (j, &i) in last.iter().enumerate() {
            let p = chunk[i].0;
            first[p * cpu.vocab..(p + 1) * cpu.vocab]
                .copy_from_slice(&logits[j * cpu.vocab..(j + 1) * cpu.vocab]);
        }
    }
    for r in 0..prompts.len() * n {
        let (p, source) = (r / n, owner[r / n] * n);
        if r != source {
            cache.copy_prefix(source, r, prompts[p].len());
        }
    }
    first
}

/// Rows per forward call when every row needs its logits: at most 16M
/// logits (64 MiB) at once, between 16 and [`PREFILL_ROWS`] rows.
fn logit_chunk(vocab: usize) -> usize {
    ((16 << 20) / vocab.max(1)).clamp(16, PREFILL_ROWS)
}

/// `log p(responses[r][j] | prompts[r] ++ responses[r][..j])` at
/// `temperature`, for every row and response token, without gradients.
/// Equal prompts are run once. The caller has checked that the kernels apply.
pub fn response_logprobs(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    temperature: f64,
) -> Result<Vec<Vec<f32>>, ModelError> {
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        return Err(ModelError::Input(format!("prompt {i} is empty")));
    }
    let vocab = model.config.vocab_size;
    if let Some(&id) = prompts
        .iter()
        .chain(responses)
        .flatten()
        .find(|&&id| id < 0 || id >= vocab)
    {
        return Err(ModelError::Input(format!(
            "the token id {id} lies outside the vocabulary 0..{vocab}"
        )));
    }
    let prepared = model.prepared_for_cpu();
    let cpu = prepared.model(model)?;
    let capacity = prompts
        .iter()
        .zip(responses)
        .map(|(p, r)| p.len() + r.len())
        .max()
        .unwrap_or(1);
    let rope = RopeTables::new(model, capacity)?;
    let mut cache = Cache::new(prepared.take_cache(), prompts.len(), &cpu, capacity);
    let mut scratch = Scratch::default();
    let pool = prepared.pool()?;
    let pool = pool.as_deref();
    let owner = owners(prompts);
    let temperature = temperature as f32;
    let mut row = Vec::with_capacity(cpu.vocab);
    let mut logprob = |logits: &[f32], target: i64| {
        row.clear();
        row.extend(logits.iter().map(|&x| x / temperature));
        // SAFETY: the caller checked that the CPU has AVX2 and FMA.
        unsafe { sample::log_prob(&mut row, target as usize) }
    };
    // SAFETY (both calls): as above.
    let first = unsafe {
        prefill(
            &cpu,
            prompts,
            &owner,
            1,
            &mut cache,
            &rope,
            &mut scratch,
            pool,
        )
    };
    let mut out: Vec<Vec<f32>> = responses
        .iter()
        .enumerate()
        .map(|(r, response)| {
            let mut lp = Vec::with_capacity(response.len());
            if let Some(&target) = response.first() {
                let o = owner[r];
                lp.push(logprob(&first[o * cpu.vocab..(o + 1) * cpu.vocab], target));
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
    for chunk in tokens.chunks(logit_chunk(cpu.vocab)) {
        let ids: Vec<i64> = chunk.iter().map(|&(r, j)| responses[r][j]).collect();
        let rows: Vec<Row> = chunk
            .iter()
            .map(|&(r, j)| Row {
                slot: r,
                pos: prompts[r].len() + j,
            })
            .collect();
        let all: Vec<usize> = (0..chunk.len()).collect();
        let logits =
            unsafe { cpu.forward(&ids, &rows, &mut cache, &rope, &mut scratch, &all, pool) };
        for (i, &(r, j)) in chunk.iter().enumerate() {
            let lp = logprob(
                &logits[i * cpu.vocab..(i + 1) * cpu.vocab],
                responses[r][j + 1],
            );
            out[r].push(lp);
        }
    }
    prepared.give_back_cache(cache.data);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Prepared {
        fn holds_packing(&self) -> bool {
            self.packed
                .lock()
                .unwrap()
                .as_ref()
                .is_some_and(|p| p.packed.is_some())
        }
    }

    #[test]
    fn a_packing_is_kept_only_while_the_weights_hold_still() {
        if !gemm::supported() {
            return;
        }
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/fixtures/models/tiny-llama");
        let model = Model::load(&dir, crate::Device::Cpu, Kind::Float).unwrap();
        let prepared = model.prepared_for_cpu();
        let step = || {
            let _guard = tch::no_grad_guard();
            for (_, mut t) in model.named_tensors() {
                let _ = t.g_mul_scalar_(1.0001);
            }
        };
        prepared.model(&model).unwrap();
        assert!(prepared.holds_packing(), "the first packing is kept");
        prepared.model(&model).unwrap();
        step();
        prepared.model(&model).unwrap();
        assert!(
            prepared.holds_packing(),
            "the last packing was reused: keep the new one"
        );
        step();
        prepared.model(&model).unwrap();
        assert!(
            !prepared.holds_packing(),
            "changed before any reuse: dropped after use"
        );
        step();
        prepared.model(&model).unwrap();
        assert!(!prepared.holds_packing(), "still changing every call");
        let packed = prepared.model(&model).unwrap();
        assert!(
            prepared.holds_packing(),
            "the same weights twice: kept again"
        );
        assert!(Arc::ptr_eq(&packed, &prepared.model(&model).unwrap()));
    }
}
