//! Masked statistics over token matrices: one row per response, one entry
//! per response token, a mask marking the tokens that count (1) and the
//! padding or masked interior tokens that do not (0).

/// A token matrix: `rows[i][t]` is token `t` of response `i`. Rows may differ in length.
pub type Tokens = [Vec<f64>];

/// Mean over masked entries: `Σ mask·x / Σ mask` (0 when the mask is empty).
pub fn masked_mean(values: &Tokens, mask: &Tokens) -> f64 {
    let (mut sum, mut count) = (0.0, 0.0);
    for (v, m) in values.iter().zip(mask) {
        for (x, k) in v.iter().zip(m) {
            sum += x * k;
            count += k;
        }
    }
    if count == 0.0 {
        0.0
    } else {
        sum / count
    }
}

/// Variance over masked entries: the masked mean of squared deviations,
/// times `n / (n − 1)` when `unbiased` (n = Σ mask; verl's default), plain
/// when not (OpenRLHF's and `torch.var(unbiased=False)`).
pub fn masked_var(values: &Tokens, mask: &Tokens, unbiased: bool) -> f64 {
    let mean = masked_mean(values, mask);
    let centered: Vec<Vec<f64>> = values
        .iter()
        .map(|v| v.iter().map(|x| (x - mean) * (x - mean)).collect())
        .collect();
    let var = masked_mean(&centered, mask);
    let n: f64 = mask.iter().flatten().sum();
    if unbiased && n > 1.0 {
        var * n / (n - 1.0)
    } else {
        var
    }
}

/// Whitening: `(x − mean) / sqrt(var + 1e-8)` with the mean and variance of
/// the masked entries (`+ mean` back when `!shift_mean`). Every entry is
/// transformed, masked ones too, as verl's and TRL's `masked_whiten` do;
/// callers multiply by the mask where they need zeros.
pub fn masked_whiten(
    values: &Tokens,
    mask: &Tokens,
    unbiased: bool,
    shift_mean: bool,
) -> Vec<Vec<f64>> {
    let mean = masked_mean(values, mask);
    let scale = 1.0 / (masked_var(values, mask, unbiased) + 1e-8).sqrt();
    let back = if shift_mean { 0.0 } else { mean };
    values
        .iter()
        .map(|v| v.iter().map(|x| (x - mean) * scale + back).collect())
        .collect()
}

/// Mean and standard deviation of a slice (`unbiased`: divide by n − 1).
pub fn mean_std(xs: &[f64], unbiased: bool) -> (f64, f64) {
    let n = xs.len() as f64;
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let mean = xs.iter().sum::<f64>() / n;
    let ss: f64 = xs.iter().map(|x| (x - mean) * (x - mean)).sum();
    let denom = if unbiased { n - 1.0 } else { n };
    let std = if denom > 0.0 {
        (ss / denom).sqrt()
    } else {
        0.0
    };
    (mean, std)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_statistics_by_hand() {
        let values = vec![vec![1.0, 2.0, 3.0, 100.0]];
        let mask = vec![vec![1.0, 1.0, 1.0, 0.0]];
        assert_eq!(masked_mean(&values, &mask), 2.0);
        assert!((masked_var(&values, &mask, true) - 1.0).abs() < 1e-12);
        assert!((masked_var(&values, &mask, false) - 2.0 / 3.0).abs() < 1e-12);
        let w = masked_whiten(&values, &mask, true, true);
        let s = 1.0 / (1.0f64 + 1e-8).sqrt();
        assert!(
            (w[0][0] + s).abs() < 1e-12 && w[0][1].abs() < 1e-12 && (w[0][2] - s).abs() < 1e-12
        );
        assert!(
            (w[0][3] - 98.0 * s).abs() < 1e-9,
            "masked entries are transformed too"
        );
        let (m, sd) = mean_std(&[1.0, 2.0, 3.0, 4.0], true);
        assert!((m - 2.5).abs() < 1e-12 && (sd - (5.0f64 / 3.0).sqrt()).abs() < 1e-12);
    }
}
