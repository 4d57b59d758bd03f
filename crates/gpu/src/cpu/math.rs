//! The element-wise and reduction kernels of a decode step, in AVX2: RMSNorm,
//! gated SiLU, dot products, attention scores and weighted value sums, and `exp` (a Cephes-style
//! polynomial, within 2 ulp of the true value over the float range; inputs
//! below −87.3 give the smallest normal float rather than 0).
//!
//! Reductions use eight lane accumulators folded at the end, so they differ
//! from a sequential sum by rounding only.
//!
//! Every function here is `unsafe`: the CPU must support AVX2 and FMA
//! ([`super::gemm::supported`]).

use std::arch::x86_64::*;

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), v);
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))
}

/// `Σ a[i]·b[i]`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        acc = _mm256_fmadd_ps(
            _mm256_loadu_ps(a.as_ptr().add(i)),
            _mm256_loadu_ps(b.as_ptr().add(i)),
            acc,
        );
        i += 8;
    }
    let mut sum = hsum(acc);
    while i < n {
        sum += a[i] * b[i];
        i += 1;
    }
    sum
}

/// Attention scores of `H` query heads against one head's transposed keys:
/// `out[h][j] = scale · Σ_c q[h][c] · keys[c · stride + j]` for `j < len`,
/// with `q` holding the heads one after another (`[H][d]`) and `out` as
/// `[H][len]`. Sixteen positions per pass; each key line is loaded once for
/// all `H` heads (the heads of a GQA group share their keys). The sum over
/// `c` runs in order, one fused multiply-add per step.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn scores_transposed<const H: usize>(
    q: &[f32],
    keys: &[f32],
    stride: usize,
    scale: f32,
    len: usize,
    out: &mut [f32],
) {
    let d = q.len() / H;
    assert!(q.len() == H * d && out.len() >= H * len);
    assert!(d == 0 || keys.len() >= (d - 1) * stride + len);
    let (k, o) = (keys.as_ptr(), out.as_mut_ptr());
    let s = _mm256_set1_ps(scale);
    let mut j = 0;
    while j + 16 <= len {
        let mut acc = [[_mm256_setzero_ps(); 2]; H];
        for c in 0..d {
            let k0 = _mm256_loadu_ps(k.add(c * stride + j));
            let k1 = _mm256_loadu_ps(k.add(c * stride + j + 8));
            for (h, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_set1_ps(q[h * d + c]);
                acc[0] = _mm256_fmadd_ps(x, k0, acc[0]);
                acc[1] = _mm256_fmadd_ps(x, k1, acc[1]);
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(h * len + j), _mm256_mul_ps(acc[0], s));
            _mm256_storeu_ps(o.add(h * len + j + 8), _mm256_mul_ps(acc[1], s));
        }
        j += 16;
    }
    while j + 8 <= len {
        let mut acc = [_mm256_setzero_ps(); H];
        for c in 0..d {
            let k0 = _mm256_loadu_ps(k.add(c * stride + j));
            for (h, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(q[h * d + c]), k0, *acc);
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(h * len + j), _mm256_mul_ps(*acc, s));
        }
        j += 8;
    }
    for j in j..len {
        for h in 0..H {
            let mut acc = 0.0f32;
            for c in 0..d {
                acc = q[h * d + c].mul_add(keys[c * stride + j], acc);
            }
            out[h * len + j] = acc * scale;
        }
    }
}

/// The attention-weighted value sums of `H` query heads sharing one value
/// head: `out[h][c] = Σ_j p[h][j] · values[j · d + c]`, with `p` as
/// `[H][len]`, `values` as `[len][d]` and `out` as `[H][d]`. Sixteen
/// columns of every head stay in registers across all positions; each value
/// line is loaded once for all `H` heads.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn weighted_sum<const H: usize>(p: &[f32], values: &[f32], len: usize, out: &mut [f32]) {
    let d = out.len() / H;
    assert!(p.len() >= H * len && out.len() == H * d && values.len() >= len * d);
    let (v, o) = (values.as_ptr(), out.as_mut_ptr());
    let mut c = 0;
    while c + 16 <= d {
        let mut acc = [[_mm256_setzero_ps(); 2]; H];
        for j in 0..len {
            let v0 = _mm256_loadu_ps(v.add(j * d + c));
            let v1 = _mm256_loadu_ps(v.add(j * d + c + 8));
            for (h, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_set1_ps(p[h * len + j]);
                acc[0] = _mm256_fmadd_ps(x, v0, acc[0]);
                acc[1] = _mm256_fmadd_ps(x, v1, acc[1]);
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(h * d + c), acc[0]);
            _mm256_storeu_ps(o.add(h * d + c + 8), acc[1]);
        }
        c += 16;
    }
    while c + 8 <= d {
        let mut acc = [_mm256_setzero_ps(); H];
        for j in 0..len {
            let v0 = _mm256_loadu_ps(v.add(j * d + c));
            for (h, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(p[h * len + j]), v0, *acc);
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(h * d + c), *acc);
        }
        c += 8;
    }
    for c in c..d {
        for h in 0..H {
            let mut acc = 0.0f32;
            for j in 0..len {
                acc = p[h * len + j].mul_add(values[j * d + c], acc);
            }
            out[h * d + c] = acc;
        }
    }
}

/// RMSNorm as transformers computes it: `weight · (x · 1/√(mean(x²) + eps))`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mean = dot(x, x) / x.len() as f32;
    let inv = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(x, _mm256_set1_ps(88.376_26));
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.336_54));
    // x = n·ln 2 + r, |r| ≤ ln 2 / 2, with ln 2 split in two for precision.
    let n = _mm256_round_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(
        _mm256_mul_ps(p, r),
        r,
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    // 2^n through the exponent bits; n ≥ −126 after the clamp above (a
    // result of 2^127 overflows to infinity as it should).
    let bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_mul_ps(y, _mm256_castsi256_ps(bits))
}

/// `exp` of every element of `x`, in place.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp_in_place(x: &mut [f32]) {
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        _mm256_storeu_ps(c.as_mut_ptr(), exp8(_mm256_loadu_ps(c.as_ptr())));
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let mut lanes = [0.0f32; 8];
        lanes[..rest.len()].copy_from_slice(rest);
        _mm256_storeu_ps(lanes.as_mut_ptr(), exp8(_mm256_loadu_ps(lanes.as_ptr())));
        rest.copy_from_slice(&lanes[..rest.len()]);
    }
}

/// The gated MLP activation: `out[i] = silu(gate[i]) · up[i]` with
/// `silu(g) = g / (1 + exp(−g))` (as libtorch computes it); `gate_up` holds
/// the gate half, then the up half.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn silu_mul(gate_up: &[f32], out: &mut [f32]) {
    let n = out.len();
    let (gate, up) = gate_up.split_at(n);
    let one = _mm256_set1_ps(1.0);
    let zero = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        let g = _mm256_loadu_ps(gate.as_ptr().add(i));
        let e = exp8(_mm256_sub_ps(zero, g));
        let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(
            out.as_mut_ptr().add(i),
            _mm256_mul_ps(s, _mm256_loadu_ps(up.as_ptr().add(i))),
        );
        i += 8;
    }
    while i < n {
        let g = gate[i];
        out[i] = g / (1.0 + (-g).exp()) * up[i];
        i += 1;
    }
}

/// The largest element (−∞ for an empty slice).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn max(x: &[f32]) -> f32 {
    x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_a_few_ulp_and_silu_matches_its_definition() {
        if !super::super::gemm::supported() {
            return;
        }
        let xs: Vec<f32> = (-8700..=8800).map(|i| i as f32 * 0.01).collect();
        let mut ys = xs.clone();
        unsafe { exp_in_place(&mut ys) };
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = (x as f64).exp();
            assert!(
                ((y as f64 - want) / want).abs() < 3e-7,
                "exp({x}) = {y}, want {want}"
            );
        }
        let gate_up: Vec<f32> = (0..38).map(|i| (i as f32 - 19.0) * 0.7).collect();
        let mut out = vec![0.0f32; 19];
        unsafe { silu_mul(&gate_up, &mut out) };
        for i in 0..19 {
            let (g, u) = (gate_up[i] as f64, gate_up[19 + i] as f64);
            let want = g / (1.0 + (-g).exp()) * u;
            assert!((out[i] as f64 - want).abs() < 1e-5 * want.abs().max(1.0));
        }
        // Attention: scores against transposed keys and weighted value sums,
        // with lengths and head sizes that leave tails.
        for (len, d) in [(37usize, 12usize), (16, 64), (5, 40)] {
            let stride = len + 3;
            // Three query heads sharing the keys and values.
            let q: Vec<f32> = (0..3 * d).map(|c| (c as f32 * 0.37).sin()).collect();
            let keys: Vec<f32> = (0..d * stride).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut scores = vec![0.0f32; 3 * len];
            unsafe { scores_transposed::<3>(&q, &keys, stride, 0.5, len, &mut scores) };
            for h in 0..3 {
                for j in 0..len {
                    let want: f64 = 0.5
                        * (0..d)
                            .map(|c| q[h * d + c] as f64 * keys[c * stride + j] as f64)
                            .sum::<f64>();
                    let got = scores[h * len + j] as f64;
                    assert!(
                        (got - want).abs() < 1e-5,
                        "score {h},{j} of {len}×{d}: {got} vs {want}"
                    );
                }
            }
            // One head alone gives the same bits as within the group.
            let mut one = vec![0.0f32; len];
            unsafe { scores_transposed::<1>(&q[d..2 * d], &keys, stride, 0.5, len, &mut one) };
            assert_eq!(one, scores[len..2 * len]);
            let values: Vec<f32> = (0..len * d).map(|i| (i as f32 * 0.07).sin()).collect();
            let mut out = vec![0.0f32; 3 * d];
            unsafe { weighted_sum::<3>(&scores, &values, len, &mut out) };
            for h in 0..3 {
                for c in 0..d {
                    let want: f64 = (0..len)
                        .map(|j| scores[h * len + j] as f64 * values[j * d + c] as f64)
                        .sum();
                    let got = out[h * d + c] as f64;
                    assert!(
                        (got - want).abs() < 1e-4,
                        "column {h},{c} of {len}×{d}: {got} vs {want}"
                    );
                }
            }
        }
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        assert_eq!(
            unsafe { dot(&a, &a) },
            (0..19).map(|i| (i * i) as f32).sum::<f32>()
        );
    }
}
