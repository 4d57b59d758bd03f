//! The decoder's KV cache: per layer, the keys and values of the positions
//! run so far, either appended in buffers that grow by doubling (a batch
//! that decodes together) or as a slot cache whose rows are sequences of
//! their own lengths (the streaming pool), which join and leave without the
//! other rows being copied.

use tch::{Kind, Tensor};

/// The keys and values of earlier positions, per layer, in buffers that
/// grow by doubling: appending a step writes in place instead of copying
/// the whole cache (which `cat` would do every step).
///
/// A cache made by [`KvCache::slots`] is laid out otherwise: its rows are
/// sequences of their own lengths, each from position 0 (right-padded),
/// that join ([`KvCache::admit`]) and leave ([`KvCache::remove`]) without
/// the other rows being copied; a decode step writes each row's new key at
/// that row's own length ([`KvCache::begin_step`]).
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    slots: Option<SlotRows>,
}

#[derive(Debug, Default)]
struct LayerCache {
    /// `[rows, heads, capacity, head_dim]`.
    keys: Option<Tensor>,
    values: Option<Tensor>,
    len: i64,
}

/// The rows of a slot cache.
#[derive(Debug, Default)]
struct SlotRows {
    /// Positions each row holds (after [`KvCache::begin_step`]: including
    /// the one the step writes).
    lens: Vec<i64>,
    /// The decode step under way.
    step: Option<SlotStep>,
}

/// A slot cache's decode step: row `rows[i]` writes at position `at[i]`,
/// and attention reads `width` positions (the longest row's, with the step's).
#[derive(Debug)]
struct SlotStep {
    rows: Tensor,
    at: Tensor,
    width: i64,
}

/// `buffer` `[rows, H, capacity, D]` grown to at least `rows` rows and
/// `positions` positions (each by doubling, positions to 64 at least),
/// keeping what `keep_rows` × `keep_positions` held; new memory is zeroed
/// if `zeroed` (a slot cache: its positions past a row's length are
/// masked, but a NaN there would still poison the attention, NaN · 0 being
/// NaN).
fn grown(
    zeroed: bool,
    buffer: Option<Tensor>,
    like: &Tensor,
    rows: i64,
    positions: i64,
    keep_rows: i64,
    keep_positions: i64,
) -> Tensor {
    let (have_rows, have_positions) = buffer
        .as_ref()
        .map_or((0, 0), |b| (b.size()[0], b.size()[2]));
    if let Some(b) = buffer
        .as_ref()
        .filter(|_| rows <= have_rows && positions <= have_positions)
    {
        return b.shallow_clone();
    }
    let mut shape = like.size();
    shape[0] = if rows > have_rows {
        rows.max(have_rows * 2)
    } else {
        have_rows
    };
    shape[2] = if positions > have_positions {
        positions.max(have_positions * 2).max(64)
    } else {
        have_positions
    };
    let fresh = if zeroed {
        Tensor::zeros(shape.as_slice(), (like.kind(), like.device()))
    } else {
        Tensor::empty(shape.as_slice(), (like.kind(), like.device()))
    };
    if let Some(old) = buffer {
        if keep_rows > 0 && keep_positions > 0 {
            fresh
                .narrow(0, 0, keep_rows)
                .narrow(2, 0, keep_positions)
                .copy_(&old.narrow(0, 0, keep_rows).narrow(2, 0, keep_positions));
        }
    }
    fresh
}

impl LayerCache {
    /// Appends `k`, `v` `[B, H, t, D]`; returns all keys and values so far.
    fn append(&mut self, k: &Tensor, v: &Tensor) -> (Tensor, Tensor) {
        let (b, t) = (k.size()[0], k.size()[2]);
        let needed = self.len + t;
        let len = self.len;
        self.keys = Some(grown(false, self.keys.take(), k, b, needed, b, len));
        self.values = Some(grown(false, self.values.take(), v, b, needed, b, len));
        let (keys, values) = (
            self.keys.as_ref().expect("allocated above"),
            self.values.as_ref().expect("allocated above"),
        );
        keys.narrow(2, self.len, t).copy_(k);
        values.narrow(2, self.len, t).copy_(v);
        self.len = needed;
        (keys.narrow(2, 0, self.len), values.narrow(2, 0, self.len))
    }

    /// A slot cache's decode step: writes `k`, `v` `[n, H, 1, D]` at row
    /// `rows[i]`, position `at[i]`; returns the first `n` rows' keys and
    /// values up to the step's width.
    fn write_rows(&mut self, k: &Tensor, v: &Tensor, step: &SlotStep) -> (Tensor, Tensor) {
        let SlotStep { rows, at, width } = step;
        let width = *width;
        let n = k.size()[0];
        let (keep_rows, len) = (self.rows(), self.len);
        let mut out = [k, v].map(|new| new.shallow_clone());
        for (buffer, new) in [&mut self.keys, &mut self.values].into_iter().zip(&mut out) {
            let b = grown(true, buffer.take(), new, n, width, keep_rows, len);
            let mut target = b.shallow_clone();
            let _ = target.index_put_(
                &[
                    Some(rows.shallow_clone()),
                    None,
                    Some(at.shallow_clone()),
                    None,
                ],
                &new.squeeze_dim(2),
                false,
            );
            *new = b.narrow(0, 0, n).narrow(2, 0, width);
            *buffer = Some(b);
        }
        self.len = self.len.max(width);
        let [keys, values] = out;
        (keys, values)
    }

    fn rows(&self) -> i64 {
        self.keys.as_ref().map_or(0, |b| b.size()[0])
    }
}

/// One layer's part of a cache during a forward pass.
pub(crate) struct LayerSlot<'a> {
    layer: &'a mut LayerCache,
    step: Option<&'a SlotStep>,
}

impl LayerSlot<'_> {
    pub(crate) fn append(self, k: &Tensor, v: &Tensor) -> (Tensor, Tensor) {
        match self.step {
            Some(step) => self.layer.write_rows(k, v, step),
            None => self.layer.append(k, v),
        }
    }
}

impl KvCache {
    /// An empty cache for `layers` layers.
    pub fn new(layers: usize) -> Self {
        KvCache {
            layers: (0..layers).map(|_| LayerCache::default()).collect(),
            slots: None,
        }
    }

    /// An empty slot cache for `layers` layers (see the type's docs).
    pub fn slots(layers: usize) -> Self {
        KvCache {
            slots: Some(SlotRows::default()),
            ..KvCache::new(layers)
        }
    }

    /// Positions cached so far (a slot cache: its longest row's).
    pub fn len(&self) -> i64 {
        match &self.slots {
            Some(s) => s.lens.iter().copied().max().unwrap_or(0),
            None => self.layers.first().map_or(0, |l| l.len),
        }
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions before the new ones of a forward pass: a slot cache in a
    /// decode step counts its longest row without the step's position.
    pub(crate) fn past(&self) -> i64 {
        match &self.slots {
            Some(SlotRows {
                step: Some(step), ..
            }) => step.width - 1,
            _ => self.len(),
        }
    }

    /// Layer `i`'s part, for a forward pass.
    pub(crate) fn layer(&mut self, i: usize) -> LayerSlot<'_> {
        let step = self.slots.as_ref().and_then(|s| s.step.as_ref());
        LayerSlot {
            layer: &mut self.layers[i],
            step,
        }
    }

    /// Keeps only batch rows `rows` (finished sequences dropped).
    pub fn select_rows(&mut self, rows: &Tensor) {
        for layer in &mut self.layers {
            for buffer in [&mut layer.keys, &mut layer.values].into_iter().flatten() {
                *buffer = buffer.index_select(0, rows);
            }
        }
    }

    /// A slot cache's rows: the positions each holds.
    pub fn row_lens(&self) -> &[i64] {
        self.slots.as_ref().map_or(&[], |s| &s.lens)
    }

    /// Joins rows of `prefilled` (a right-padded prefill run in a plain
    /// cache of its own) after a slot cache's rows: new row `j` is
    /// prefilled row `from[j]` (row `j` without `from`) and holds `lens[j]`
    /// positions. Only the new rows are copied, once each.
    pub fn admit(&mut self, prefilled: &KvCache, lens: &[i64], from: Option<&Tensor>) {
        let slots = self.slots.as_mut().expect("admit needs a slot cache");
        let (n, p) = (slots.lens.len() as i64, lens.len() as i64);
        let width = prefilled.len();
        for (mine, theirs) in self.layers.iter_mut().zip(&prefilled.layers) {
            let len = mine.len;
            for (buffer, new) in [
                (&mut mine.keys, &theirs.keys),
                (&mut mine.values, &theirs.values),
            ] {
                let new = new.as_ref().expect("the prefill cached its keys");
                let b = grown(true, buffer.take(), new, n + p, width, n, len);
                let rows = new.narrow(2, 0, width);
                let rows = match from {
                    Some(from) => rows.index_select(0, from),
                    None => rows,
                };
                b.narrow(0, n, p).narrow(2, 0, width).copy_(&rows);
                *buffer = Some(b);
            }
            mine.len = mine.len.max(width);
        }
        slots.lens.extend_from_slice(lens);
    }

    /// Removes a slot cache's `rows`; the last remaining rows move into
    /// their places (only those are copied). Returns the moves, `(from, to)`.
    pub fn remove(&mut self, rows: &[usize]) -> Vec<(usize, usize)> {
        let slots = self.slots.as_mut().expect("remove needs a slot cache");
        let n = slots.lens.len();
        let keep = n - rows.len();
        let holes: Vec<usize> = rows.iter().copied().filter(|&r| r < keep).collect();
        let movers: Vec<usize> = (keep..n).filter(|r| !rows.contains(r)).collect();
        let moves: Vec<(usize, usize)> = movers.into_iter().zip(holes).collect();
        if !moves.is_empty() {
            let width = moves
                .iter()
                .map(|&(from, _)| slots.lens[from])
                .max()
                .unwrap_or(0);
            for layer in &mut self.layers {
                for buffer in [&layer.keys, &layer.values].into_iter().flatten() {
                    let index = |pick: fn(&(usize, usize)) -> usize| {
                        let ids: Vec<i64> = moves.iter().map(|m| pick(m) as i64).collect();
                        Tensor::from_slice(&ids).to_device(buffer.device())
                    };
                    let mut view = buffer.narrow(2, 0, width);
                    let moved = view.index_select(0, &index(|m| m.0));
                    let _ = view.index_copy_(0, &index(|m| m.1), &moved);
                }
            }
        }
        for &(from, to) in &moves {
            slots.lens[to] = slots.lens[from];
        }
        slots.lens.truncate(keep);
        moves
    }

    /// Starts a slot cache's decode step of one token per row: each row's
    /// key goes to the position after what it holds. Returns the key mask
    /// `[rows, longest + 1]` and the new tokens' positions `[rows, 1]` to
    /// run the step with.
    pub fn begin_step(&mut self, device: tch::Device) -> (Tensor, Tensor) {
        let slots = self.slots.as_mut().expect("begin_step needs a slot cache");
        let n = slots.lens.len() as i64;
        let at = Tensor::from_slice(&slots.lens).to_device(device);
        let rows = Tensor::arange(n, (Kind::Int64, device));
        for len in &mut slots.lens {
            *len += 1;
        }
        let width = slots.lens.iter().copied().max().unwrap_or(0);
        let mask = Tensor::arange(width, (Kind::Int64, device))
            .view([1, width])
            .le_tensor(&at.view([n, 1]))
            .to_kind(Kind::Int64);
        let positions = at.view([n, 1]);
        slots.step = Some(SlotStep { rows, at, width });
        (mask, positions)
    }

    /// Ends a decode step begun by [`KvCache::begin_step`].
    pub fn end_step(&mut self) {
        if let Some(slots) = self.slots.as_mut() {
            slots.step = None;
        }
    }
}
