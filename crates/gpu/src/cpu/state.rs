//! The state of one call on the CPU kernels: per-sequence KV-cache slots,
//! RoPE tables, and the activations of a forward pass.

use tch::{Kind, Tensor};

use crate::error::ModelError;
use crate::rope::Rope;

/// The sizes of a packed model that a call's cache and activations are
/// laid out by.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    pub(super) layers: usize,
    pub(super) hidden: usize,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) intermediate: usize,
    pub(super) vocab: usize,
}

/// A token's cache slot (its sequence) and position.
#[derive(Clone, Copy, Debug)]
pub(super) struct Row {
    pub(super) slot: usize,
    pub(super) pos: usize,
}

/// cos and sin of every position up to the longest sequence, `[len, head_dim]`.
pub(super) struct RopeTables {
    cos: Vec<f32>,
    sin: Vec<f32>,
    dim: usize,
}

impl RopeTables {
    /// The tables of `rope` (heads of `dim`) for positions `0..len`.
    pub(super) fn new(rope: &Rope, dim: usize, len: usize) -> Result<Self, ModelError> {
        let positions = Tensor::arange(len as i64, (Kind::Int64, tch::Device::Cpu)).view([1, -1]);
        let (cos, sin) = rope.tables(&positions, Kind::Float);
        let flat = |t: Tensor| {
            Vec::<f32>::try_from(&t.contiguous().view(-1))
                .map_err(|e| ModelError::Torch(e.to_string()))
        };
        Ok(RopeTables {
            cos: flat(cos)?,
            sin: flat(sin)?,
            dim,
        })
    }

    pub(super) fn at(&self, pos: usize) -> (&[f32], &[f32]) {
        let span = pos * self.dim..(pos + 1) * self.dim;
        (&self.cos[span.clone()], &self.sin[span])
    }
}

/// Keys and values of every sequence, slot-major: per (slot, layer, k|v, kv
/// head) a block of `capacity × head_dim` floats. Keys are stored
/// transposed (`[head_dim][position]`), so the scores of consecutive
/// positions are one vector product; values by position
/// (`[position][head_dim]`).
pub(super) struct Cache {
    pub(super) data: Vec<f32>,
    layers: usize,
    kv_heads: usize,
    pub(super) capacity: usize,
    dim: usize,
}

impl Cache {
    /// A cache in `data` (resized; every position is written before it is read).
    pub(super) fn new(mut data: Vec<f32>, slots: usize, model: Shape, capacity: usize) -> Self {
        let layers = model.layers;
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

    /// Sequences the cache holds.
    pub(super) fn slots(&self) -> usize {
        self.data.len() / (self.layers * 2 * self.kv_heads * self.capacity * self.dim).max(1)
    }

    /// Start of the block of (slot, layer, keys (0) or values (1), head).
    pub(super) fn block(&self, slot: usize, layer: usize, which: usize, head: usize) -> usize {
        (((slot * self.layers + layer) * 2 + which) * self.kv_heads + head)
            * self.capacity
            * self.dim
    }

    /// Stores the key and value of `head` at `pos`.
    pub(super) fn put(
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
    pub(super) fn keys(&self, slot: usize, layer: usize, head: usize) -> &[f32] {
        let start = self.block(slot, layer, 0, head);
        &self.data[start..start + self.capacity * self.dim]
    }

    /// The values of `head` at positions `0..len` (`[len][head_dim]`).
    pub(super) fn values(&self, slot: usize, layer: usize, head: usize, len: usize) -> &[f32] {
        let start = self.block(slot, layer, 1, head);
        &self.data[start..start + len * self.dim]
    }

    /// Copies the first `len` positions of `slot` into the same slot of
    /// `to` (a cache of the same model with another capacity).
    pub(super) fn copy_slot_into(&self, slot: usize, len: usize, to: &mut Cache) {
        let d = self.dim;
        for layer in 0..self.layers {
            for head in 0..self.kv_heads {
                let (src, dst) = (
                    self.block(slot, layer, 0, head),
                    to.block(slot, layer, 0, head),
                );
                for c in 0..d {
                    to.data[dst + c * to.capacity..dst + c * to.capacity + len].copy_from_slice(
                        &self.data[src + c * self.capacity..src + c * self.capacity + len],
                    );
                }
                let (src, dst) = (
                    self.block(slot, layer, 1, head),
                    to.block(slot, layer, 1, head),
                );
                to.data[dst..dst + len * d].copy_from_slice(&self.data[src..src + len * d]);
            }
        }
    }

    /// Copies the first `len` positions of slot `from` into slot `to`.
    pub(super) fn copy_prefix(&mut self, from: usize, to: usize, len: usize) {
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
pub(super) struct Scratch {
    pub(super) x: Vec<f32>,
    pub(super) xn: Vec<f32>,
    pub(super) qkv: Vec<f32>,
    pub(super) att: Vec<f32>,
    pub(super) gate_up: Vec<f32>,
    pub(super) act: Vec<f32>,
    pub(super) logits: Vec<f32>,
    pub(super) head: Vec<f32>,
}

impl Scratch {
    pub(super) fn reserve(&mut self, m: usize, model: Shape, logit_rows: usize) {
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
