//! Matrix products `C (+)= A · Wᵀ + bias` against a weight packed once, for
//! the small-M shapes of decoding (M = live sequences, a few dozen rows).
//!
//! A `Linear` weight `W` `[n, k]` is packed into panels of [`NR`] output
//! features: panel `p` holds, for every `k`, the 16 values `W[16p..16p+16, k]`
//! side by side, so the kernel streams one panel with two vector loads per
//! `k` and never copies the weight again (libtorch's sgemm re-packs it on
//! every call, which at these shapes costs as much as the arithmetic).
//! The kernel keeps a block of up to [`MR`] rows × 16 columns in 12 AVX2
//! registers. Every output element is summed in the same order (`k`
//! ascending, one fused multiply-add per step), whatever the number of rows,
//! so a sequence's results do not depend on what else is in the batch.

use std::arch::x86_64::*;

/// Output features per panel (two AVX2 vectors).
pub const NR: usize = 16;
/// Rows per kernel call.
pub const MR: usize = 6;

/// A weight `[n, k]` (PyTorch `Linear` layout) packed for [`matmul`], with its bias.
#[derive(Debug, Clone)]
pub struct Packed {
    /// Input features.
    pub k: usize,
    /// Output features.
    pub n: usize,
    panels: Vec<f32>,
    bias: Option<Vec<f32>>,
}

impl Packed {
    /// Packs `weight` (`n` rows of `k`, row-major) and an optional bias of `n`.
    pub fn new(weight: &[f32], n: usize, k: usize, bias: Option<Vec<f32>>) -> Self {
        assert_eq!(weight.len(), n * k, "weight is not [{n}, {k}]");
        if let Some(b) = &bias {
            assert_eq!(b.len(), n, "bias is not [{n}]");
        }
        let count = n.div_ceil(NR);
        let mut panels = vec![0.0f32; count * k * NR];
        for p in 0..count {
            let panel = &mut panels[p * k * NR..(p + 1) * k * NR];
            for j in 0..NR.min(n - p * NR) {
                let row = &weight[(p * NR + j) * k..(p * NR + j + 1) * k];
                for (kk, &w) in row.iter().enumerate() {
                    panel[kk * NR + j] = w;
                }
            }
        }
        Packed { k, n, panels, bias }
    }

    /// Writes row `i` of the weight (`k` values: `W[i, ..]`) into `out`.
    pub fn row(&self, i: usize, out: &mut [f32]) {
        assert!(
            i < self.n && out.len() == self.k,
            "row {i} of [{}, {}]",
            self.n,
            self.k
        );
        let panel = &self.panels[(i / NR) * self.k * NR..];
        for (kk, o) in out.iter_mut().enumerate() {
            *o = panel[kk * NR + i % NR];
        }
    }
}

/// True when this CPU runs the kernels (x86-64 with AVX2 and FMA).
pub fn supported() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// Depth of one block of the product: a block of the weight panel
/// (16 KiB) and of six packed input rows (6 KiB) stay in L1 together.
const KC: usize = 256;

thread_local! {
    static PACKED_A: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Products smaller than this (multiply-adds) stay on the calling thread.
const PARALLEL_MACS: usize = 1 << 21;

/// `c` shared by the threads of one product; each writes its own columns.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: the threads of one `matmul` write disjoint column ranges of `c`.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// `c[i, j] (+)= Σ_k a[i, k] · W[j, k] + bias[j]` for `m` rows; `a` has row
/// stride `lda` (≥ k), `c` row stride `ldc` (≥ n). With `accumulate` the
/// product (and bias) is added to `c` (a residual connection), else written.
///
/// The depth is cut into blocks of `KC` (256) and the rows of `a` are packed six
/// at a time (`[depth block][row block][k][6]`) so the kernel reads them in
/// order. With a `pool`, large products split their weight panels among its
/// threads; each output element is computed the same way either way.
///
/// # Safety
/// The CPU must support AVX2 and FMA ([`supported`]).
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul(
    a: &[f32],
    lda: usize,
    m: usize,
    w: &Packed,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    pool: Option<&rayon::ThreadPool>,
) {
    if m == 0 {
        return;
    }
    assert!(lda >= w.k && ldc >= w.n);
    assert!(a.len() >= (m - 1) * lda + w.k, "a is too short");
    assert!(c.len() >= (m - 1) * ldc + w.n, "c is too short");
    let blocks = m.div_ceil(MR);
    let depth_blocks = w.k.div_ceil(KC);
    PACKED_A.with(|packed| {
        let mut packed = packed.borrow_mut();
        packed.resize(depth_blocks * blocks * KC * MR, 0.0);
        for d in 0..depth_blocks {
            let (k0, kc) = (d * KC, KC.min(w.k - d * KC));
            for block in 0..blocks {
                let start = (d * blocks + block) * KC * MR;
                let dst = &mut packed[start..start + KC * MR];
                for r in 0..MR.min(m - block * MR) {
                    let row = (block * MR + r) * lda + k0;
                    for (kk, &v) in a[row..row + kc].iter().enumerate() {
                        dst[kk * MR + r] = v;
                    }
                }
            }
        }
        let panels = w.n.div_ceil(NR);
        let out = Out(c.as_mut_ptr());
        let job = Job {
            a: &packed,
            m,
            blocks,
            w,
            ldc,
            accumulate,
        };
        let threads = pool.map_or(1, |p| p.current_num_threads()).min(panels);
        if threads > 1 && m * w.k * w.n >= PARALLEL_MACS {
            let per = panels.div_ceil(threads);
            pool.expect("threads > 1 comes from a pool").scope(|scope| {
                for t in 1..threads {
                    let job = &job;
                    scope.spawn(move |_| job.run(t * per..((t + 1) * per).min(panels), out));
                }
                job.run(0..per, out);
            });
        } else {
            job.run(0..panels, out);
        }
    });
}

/// One product: packed rows against a range of weight panels.
struct Job<'a> {
    a: &'a [f32],
    m: usize,
    blocks: usize,
    w: &'a Packed,
    ldc: usize,
    accumulate: bool,
}

impl Job<'_> {
    /// Computes the columns of `panels` into `c`.
    unsafe fn run(&self, panels: std::ops::Range<usize>, c: Out) {
        let w = self.w;
        let panel_len = w.k * NR;
        for d in 0..w.k.div_ceil(KC) {
            let (k0, kc) = (d * KC, KC.min(w.k - d * KC));
            let last = k0 + kc == w.k;
            for p in panels.clone() {
                let cols = NR.min(w.n - p * NR);
                let start = p * panel_len + k0 * NR;
                let tile = Tile {
                    kc,
                    panel: &w.panels[start..start + kc * NR],
                    cols,
                    load: self.accumulate || k0 > 0,
                    bias: if last {
                        w.bias.as_ref().map(|b| &b[p * NR..p * NR + cols])
                    } else {
                        None
                    },
                };
                for block in 0..self.blocks {
                    let rows = MR.min(self.m - block * MR);
                    let a = &self.a[(d * self.blocks + block) * KC * MR..];
                    let out = c.0.add(block * MR * self.ldc + p * NR);
                    match rows {
                        6 => kernel::<6>(&tile, a, out, self.ldc),
                        5 => kernel::<5>(&tile, a, out, self.ldc),
                        4 => kernel::<4>(&tile, a, out, self.ldc),
                        3 => kernel::<3>(&tile, a, out, self.ldc),
                        2 => kernel::<2>(&tile, a, out, self.ldc),
                        _ => kernel::<1>(&tile, a, out, self.ldc),
                    }
                }
            }
        }
    }
}

/// One block of the depth against one weight panel.
struct Tile<'a> {
    kc: usize,
    panel: &'a [f32],
    cols: usize,
    /// Start from the values in `c` (a residual, or earlier depth blocks).
    load: bool,
    /// Added at the end (last depth block only).
    bias: Option<&'a [f32]>,
}

/// `R` rows × `t.cols` (≤ 16) columns: `a` is packed `[k][6]`; `c` points
/// at the tile's first element, rows `ldc` apart (the caller checked bounds).
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel<const R: usize>(t: &Tile, a: &[f32], c: *mut f32, ldc: usize) {
    debug_assert!(a.len() >= t.kc * MR && t.panel.len() >= t.kc * NR);
    let mut tile = [0.0f32; NR];
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    if t.load {
        for (r, acc) in acc.iter_mut().enumerate() {
            let row = c.add(r * ldc);
            if t.cols == NR {
                acc[0] = _mm256_loadu_ps(row);
                acc[1] = _mm256_loadu_ps(row.add(8));
            } else {
                std::ptr::copy_nonoverlapping(row, tile.as_mut_ptr(), t.cols);
                acc[0] = _mm256_loadu_ps(tile.as_ptr());
                acc[1] = _mm256_loadu_ps(tile.as_ptr().add(8));
            }
        }
    }
    let a = a.as_ptr();
    let b = t.panel.as_ptr();
    let step = |kk: usize, acc: &mut [[__m256; 2]; R]| {
        let b0 = _mm256_loadu_ps(b.add(kk * NR));
        let b1 = _mm256_loadu_ps(b.add(kk * NR + 8));
        for (r, acc) in acc.iter_mut().enumerate() {
            let x = _mm256_broadcast_ss(&*a.add(kk * MR + r));
            acc[0] = _mm256_fmadd_ps(x, b0, acc[0]);
            acc[1] = _mm256_fmadd_ps(x, b1, acc[1]);
        }
    };
    let mut kk = 0;
    while kk + 4 <= t.kc {
        step(kk, &mut acc);
        step(kk + 1, &mut acc);
        step(kk + 2, &mut acc);
        step(kk + 3, &mut acc);
        kk += 4;
    }
    while kk < t.kc {
        step(kk, &mut acc);
        kk += 1;
    }
    if let Some(bias) = t.bias {
        tile = [0.0; NR];
        tile[..t.cols].copy_from_slice(bias);
        let (b0, b1) = (
            _mm256_loadu_ps(tile.as_ptr()),
            _mm256_loadu_ps(tile.as_ptr().add(8)),
        );
        for acc in acc.iter_mut() {
            acc[0] = _mm256_add_ps(acc[0], b0);
            acc[1] = _mm256_add_ps(acc[1], b1);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let row = c.add(r * ldc);
        if t.cols == NR {
            _mm256_storeu_ps(row, acc[0]);
            _mm256_storeu_ps(row.add(8), acc[1]);
        } else {
            _mm256_storeu_ps(tile.as_mut_ptr(), acc[0]);
            _mm256_storeu_ps(tile.as_mut_ptr().add(8), acc[1]);
            std::ptr::copy_nonoverlapping(tile.as_ptr(), row, t.cols);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(a: &[f32], m: usize, w: &[f32], n: usize, k: usize, bias: &[f32]) -> Vec<f64> {
        let mut c = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = bias[j] as f64
                    + (0..k)
                        .map(|kk| a[i * k + kk] as f64 * w[j * k + kk] as f64)
                        .sum::<f64>();
            }
        }
        c
    }

    #[test]
    fn matches_a_float64_product_for_ragged_shapes_and_is_row_independent() {
        if !supported() {
            return;
        }
        let mut seed = 7u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1 << 24) as f32 - 0.5
        };
        for (m, n, k) in [(1, 1, 1), (7, 33, 19), (13, 16, 64), (64, 40, 128)] {
            let a: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let bias: Vec<f32> = (0..n).map(|_| next()).collect();
            let packed = Packed::new(&w, n, k, Some(bias.clone()));
            // Every row reads back from the panels (a tied embedding's lookup).
            let mut row = vec![0.0f32; k];
            for i in 0..n {
                packed.row(i, &mut row);
                assert_eq!(row, w[i * k..(i + 1) * k], "row {i} of {n}x{k}");
            }
            let mut c = vec![0.0f32; m * n];
            unsafe { matmul(&a, k, m, &packed, &mut c, n, false, None) };
            let want = reference(&a, m, &w, n, k, &bias);
            for (x, y) in c.iter().zip(&want) {
                assert!((*x as f64 - y).abs() < 1e-4, "{m}x{n}x{k}: {x} vs {y}");
            }
            // Accumulating adds the same product again.
            unsafe { matmul(&a, k, m, &packed, &mut c, n, true, None) };
            for (x, y) in c.iter().zip(&want) {
                assert!((*x as f64 - 2.0 * y).abs() < 2e-4);
            }
            // The last row alone gives bit-identical results.
            let mut last = vec![0.0f32; n];
            unsafe { matmul(&a[(m - 1) * k..], k, 1, &packed, &mut last, n, false, None) };
            let mut again = vec![0.0f32; m * n];
            unsafe { matmul(&a, k, m, &packed, &mut again, n, false, None) };
            assert_eq!(last, again[(m - 1) * n..]);
        }
        // Split among threads, the same bits.
        let (m, n, k) = (64, 200, 300);
        let a: Vec<f32> = (0..m * k).map(|_| next()).collect();
        let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
        let packed = Packed::new(&w, n, k, None);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let (mut one, mut three) = (vec![1.0f32; m * n], vec![1.0f32; m * n]);
        unsafe {
            matmul(&a, k, m, &packed, &mut one, n, true, None);
            matmul(&a, k, m, &packed, &mut three, n, true, Some(&pool));
        }
        assert_eq!(one, three);
    }
}
