//! Reward shaping and the KL coefficient schedule.

/// DAPO's soft overlong penalty, added to a response's reward: with
/// `expected = max_len − buffer`, a response of `len` tokens gets
/// `min(−(len − expected) / buffer · factor, 0)` — nothing up to `expected`,
/// then a penalty growing linearly to `−factor` at `max_len` (and beyond).
pub fn overlong_penalty(len: usize, max_len: usize, buffer: usize, factor: f64) -> f64 {
    if buffer == 0 {
        return 0.0;
    }
    let expected = max_len as f64 - buffer as f64;
    let exceed = len as f64 - expected;
    (-exceed / buffer as f64 * factor).min(0.0)
}

/// ProRL's stop-properly penalty (OpenRLHF 0.11's
/// `apply_stop_properly_penalty`, `--reward.stop_properly_penalty_coef`):
/// the reward of a truncated response (`finish_reason = "length"`) is
/// scaled by `coef` when `coef ≥ 0` (in [0, 1]) and replaced by `coef`
/// when it is negative; a response that stopped keeps its reward.
pub fn stop_properly(reward: f64, truncated: bool, coef: f64) -> f64 {
    match (truncated, coef < 0.0) {
        (false, _) => reward,
        (true, true) => coef,
        (true, false) => reward * coef,
    }
}

/// The KL coefficient: fixed, or adapted towards a target KL (Ziegler et al.
/// 2019, as OpenRLHF and verl implement it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KlController {
    /// A constant coefficient.
    Fixed {
        /// The coefficient.
        value: f64,
    },
    /// `value ← value · (1 + clip(kl / target − 1, −0.2, 0.2) · n_steps / horizon)`.
    Adaptive {
        /// The current coefficient.
        value: f64,
        /// The KL to steer towards.
        target: f64,
        /// How many samples the adjustment is spread over.
        horizon: f64,
    },
}

impl KlController {
    /// The current coefficient.
    pub fn value(&self) -> f64 {
        match self {
            KlController::Fixed { value } | KlController::Adaptive { value, .. } => *value,
        }
    }

    /// Updates the coefficient after observing `current_kl` over `n_steps` samples.
    pub fn update(&mut self, current_kl: f64, n_steps: f64) {
        if let KlController::Adaptive {
            value,
            target,
            horizon,
        } = self
        {
            let error = (current_kl / *target - 1.0).clamp(-0.2, 0.2);
            *value *= 1.0 + error * n_steps / *horizon;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlong_penalty_by_hand() {
        assert_eq!(overlong_penalty(100, 128, 16, 1.0), 0.0);
        assert_eq!(overlong_penalty(112, 128, 16, 1.0), 0.0);
        assert_eq!(overlong_penalty(120, 128, 16, 1.0), -0.5);
        assert_eq!(overlong_penalty(128, 128, 16, 2.0), -2.0);
        assert_eq!(overlong_penalty(120, 128, 0, 1.0), 0.0);
    }

    #[test]
    fn adaptive_kl_moves_towards_the_target() {
        let mut c = KlController::Adaptive {
            value: 0.1,
            target: 6.0,
            horizon: 10000.0,
        };
        c.update(12.0, 100.0); // error clipped to 0.2
        assert!((c.value() - 0.1 * (1.0 + 0.2 * 0.01)).abs() < 1e-15);
        c.update(3.0, 100.0); // error −0.5 → −0.2
        assert!(c.value() < 0.1 * 1.002);
        let mut f = KlController::Fixed { value: 0.05 };
        f.update(100.0, 1.0);
        assert_eq!(f.value(), 0.05);
    }
}
