//! Checks of values that parse but make no sense, each naming its key.

use super::{ConfigError, RunConfig};
use crate::PipelineKind;

impl RunConfig {
    /// Checks values that parse but make no sense, naming the key.
    pub fn validate(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        let bad = |key: &str, value: String, why: &str| {
            Err(ConfigError {
                source_name: "config".into(),
                message: format!("`{key}` = {value}: {why}"),
            })
        };
        let one_of = |key: &str, value: &str, allowed: &[&str]| {
            if allowed.contains(&value) {
                Ok(())
            } else {
                bad(
                    key,
                    format!("{value:?}"),
                    &format!("must be one of {allowed:?}"),
                )
            }
        };
        if self.model.path.is_empty() {
            return bad(
                "model.path",
                "\"\"".into(),
                "the actor's checkpoint folder is required",
            );
        }
        if self.run.steps == 0 {
            return bad("run.steps", "0".into(), "must be at least 1");
        }
        if self.run.threads == 0 {
            return bad("run.threads", "0".into(), "must be at least 1");
        }
        one_of("run.device", &self.run.device, &["cpu", "cuda"])?;
        one_of(
            "placement.reference",
            &self.placement.reference,
            &["train", "rollout"],
        )?;
        one_of("model.dtype", &self.model.dtype, &["f32", "bf16", "f16"])?;
        let p = &self.placement;
        if p.workers == 0 {
            return bad("placement.workers", "0".into(), "must be at least 1");
        }
        for (key, set) in [
            ("placement.rollout", &p.rollout),
            ("placement.train", &p.train),
        ] {
            if set.is_empty() {
                return bad(key, "[]".into(), "needs at least one worker");
            }
            if let Some(w) = set.iter().find(|w| **w >= p.workers) {
                return bad(
                    key,
                    format!("{set:?}"),
                    &format!("worker {w} ≥ placement.workers = {}", p.workers),
                );
            }
        }
        if self.data.prompts_per_step == 0 {
            return bad("data.prompts_per_step", "0".into(), "must be at least 1");
        }
        if self.data.samples_per_prompt == 0 {
            return bad("data.samples_per_prompt", "0".into(), "must be at least 1");
        }
        if pipeline.is_group() && self.data.samples_per_prompt < 2 {
            return bad(
                "data.samples_per_prompt",
                self.data.samples_per_prompt.to_string(),
                "group estimators need at least 2 samples per prompt",
            );
        }
        if self.generate.max_new_tokens == 0 {
            return bad("generate.max_new_tokens", "0".into(), "must be at least 1");
        }
        if self.generate.temperature.is_nan() || self.generate.temperature <= 0.0 {
            return bad(
                "generate.temperature",
                self.generate.temperature.to_string(),
                "must be > 0",
            );
        }
        if !(self.generate.top_p > 0.0 && self.generate.top_p <= 1.0) {
            return bad(
                "generate.top_p",
                self.generate.top_p.to_string(),
                "must be in (0, 1]",
            );
        }
        one_of(
            "reward.kind",
            &self.reward.kind,
            &["rule", "model", "remote"],
        )?;
        if self.reward.kind == "rule"
            && weir_operators::rewards::rule_reward(&self.reward.rule).is_none()
        {
            return bad(
                "reward.rule",
                format!("{:?}", self.reward.rule),
                &format!("must be one of {:?}", weir_operators::rewards::RULE_REWARDS),
            );
        }
        if self.reward.kind == "model" && self.model.reward_model.is_empty() {
            return bad(
                "model.reward_model",
                "\"\"".into(),
                "reward.kind = \"model\" needs a reward model",
            );
        }
        if self.reward.kind == "remote" && self.reward.url.is_empty() {
            return bad(
                "reward.url",
                "\"\"".into(),
                "reward.kind = \"remote\" needs a server URL",
            );
        }
        let a = &self.algorithm;
        if !(a.lr > 0.0 && a.lr.is_finite()) {
            return bad(
                "algorithm.lr",
                a.lr.to_string(),
                "must be a positive number",
            );
        }
        one_of("algorithm.schedule", &a.schedule, &["constant", "cosine"])?;
        one_of(
            "algorithm.kl_estimator",
            &a.kl_estimator,
            &["k1", "k2", "k3"],
        )?;
        one_of(
            "algorithm.aggregation",
            &a.aggregation,
            &[
                "token-mean",
                "seq-mean-token-mean",
                "seq-mean-token-sum",
                "seq-mean-token-sum-norm",
            ],
        )?;
        one_of("algorithm.flavor", &a.flavor, &["openrlhf", "verl"])?;
        if a.micro_batch == 0 {
            return bad("algorithm.micro_batch", "0".into(), "must be at least 1");
        }
        if a.ppo_epochs == 0 {
            return bad("algorithm.ppo_epochs", "0".into(), "must be at least 1");
        }
        if a.clip_low < 0.0 || a.clip_low >= 1.0 {
            return bad(
                "algorithm.clip_low",
                a.clip_low.to_string(),
                "must be in [0, 1)",
            );
        }
        if a.clip_high < 0.0 {
            return bad(
                "algorithm.clip_high",
                a.clip_high.to_string(),
                "must be ≥ 0",
            );
        }
        if a.dual_clip != 0.0 && a.dual_clip <= 1.0 {
            return bad(
                "algorithm.dual_clip",
                a.dual_clip.to_string(),
                "must be > 1 (or 0: off)",
            );
        }
        if a.kl_coef < 0.0 {
            return bad("algorithm.kl_coef", a.kl_coef.to_string(), "must be ≥ 0");
        }
        if self.dynamic_sampling.enabled && !pipeline.is_group() {
            return bad(
                "dynamic_sampling.enabled",
                "true".into(),
                "needs a group estimator (grpo, dr_grpo, rloo)",
            );
        }
        one_of(
            "algorithm.preference_loss",
            &a.preference_loss,
            &["dpo", "cdpo", "ipo"],
        )?;
        if a.beta.is_nan() || a.beta <= 0.0 {
            return bad("algorithm.beta", a.beta.to_string(), "must be > 0");
        }
        if !(0.0..0.5).contains(&a.label_smoothing) {
            return bad(
                "algorithm.label_smoothing",
                a.label_smoothing.to_string(),
                "must be in [0, 0.5)",
            );
        }
        if self.eval.batch == 0 {
            return bad("eval.batch", "0".into(), "must be at least 1");
        }
        Ok(())
    }
}
