//! The order in which a config's checks run, and the checks that read
//! more than one section. Each section's own checks (values that parse but
//! make no sense, each naming its key) live in its file beside its keys
//! (`run.rs`, `data.rs`, …); those here span sections: a reward model for
//! `reward.kind = "model"`, the overlong buffer below
//! `generate.max_new_tokens`, the checkpoints that read the actor's token
//! ids, training from logs, and the like. Then which keys the pipeline
//! reads (`scope.rs`).

use super::{ConfigError, CorrectionChoice, RewardKind, RunConfig};
use crate::PipelineKind;

/// The error for `key` = `value`, saying `why` it makes no sense.
pub(super) fn bad(key: &str, value: String, why: &str) -> Result<(), ConfigError> {
    Err(ConfigError {
        source_name: "config".into(),
        message: format!("`{key}` = {value}: {why}"),
    })
}

impl RunConfig {
    /// Checks values that parse but make no sense, naming the key: the
    /// sections in the order they are documented, each section's own
    /// checks with those that read it beside others where they fall.
    pub fn validate(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        self.model.check()?;
        self.run.check()?;
        self.check_teacher(pipeline)?;
        self.check_scorers(pipeline)?;
        if self.uses_judge() {
            self.judge.check()?;
        }
        self.check_placement()?;
        self.check_data(pipeline)?;
        self.generate.check()?;
        self.check_reward(pipeline)?;
        self.check_eval(pipeline)?;
        self.check_lora()?;
        self.algorithm.check_policy_loss()?;
        self.check_updates(pipeline)?;
        self.check_dynamic_sampling(pipeline)?;
        self.check_agent(pipeline)?;
        self.check_scope(pipeline)
    }

    /// distill's `[teacher]` and GKD's term, and a top k that both
    /// vocabularies hold.
    fn check_teacher(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        if pipeline != PipelineKind::Distill {
            return Ok(());
        }
        self.teacher.check()?;
        self.algorithm.check_gkd()?;
        let teacher = &self.teacher.path;
        let shown = format!("{:?}", teacher.display().to_string());
        let k = self.teacher.top_k;
        if k > 0 {
            let vocab = match weir_gpu::ModelConfig::load(teacher) {
                Ok(c) => c.vocab_size,
                Err(e) => return bad("teacher.path", shown, &e.to_string()),
            };
            // The top k are read among the ids both vocabularies hold.
            let student =
                weir_gpu::ModelConfig::load(&self.model.path).map_or(vocab, |c| c.vocab_size);
            if k as i64 > vocab.min(student) {
                return bad(
                    "teacher.top_k",
                    k.to_string(),
                    &format!(
                        "the teacher's vocabulary has {vocab} tokens, the student's {student}"
                    ),
                );
            }
        }
        Ok(())
    }

    /// The checkpoints that read the policy's token ids (the teacher, a
    /// reference, reward model or critic of their own) can score them
    /// ([`unread_policy_ids`]). A reward model that cannot reads each row
    /// as text with its own tokenizer instead (then the critic must not
    /// start from it). Folders that do not load are left to the checks
    /// that load them.
    fn check_scorers(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        if matches!(pipeline, PipelineKind::Sft | PipelineKind::Rm) {
            return Ok(());
        }
        let m = &self.model;
        let mut scorers = vec![
            ("model.reference", "the reference", m.reference.as_ref()),
            (
                "model.reward_model",
                "the reward model",
                m.reward_model.as_ref(),
            ),
            ("model.critic", "the critic", m.critic.as_ref()),
        ];
        if pipeline == PipelineKind::Distill {
            scorers.push(("teacher.path", "the teacher", Some(&self.teacher.path)));
        }
        for (key, role, dir) in scorers {
            let Some(dir) = dir.filter(|d| **d != m.path) else {
                continue;
            };
            let shown = format!("{:?}", dir.display().to_string());
            let why = match unread_policy_ids(&m.path, dir, role) {
                Ok(None) => continue,
                Ok(Some(why)) => why,
                Err(e) => return bad(key, shown, &e),
            };
            if key != "model.reward_model" {
                return bad(
                    key,
                    shown,
                    &format!("{why} ({role} scores the policy's token ids)"),
                );
            }
            // A reward model reads text with its own tokenizer; a critic
            // started from it would score the policy's ids.
            if pipeline == PipelineKind::Ppo && m.critic.is_none() {
                return bad(
                    "model.critic",
                    "\"\"".into(),
                    &format!(
                        "the critic would start from model.reward_model ({shown}), which cannot read the policy's token ids ({why}); set model.critic to a checkpoint that does"
                    ),
                );
            }
        }
        Ok(())
    }

    /// `[placement]`, with a judge's workers only where a judge scores.
    pub(super) fn check_placement(&self) -> Result<(), ConfigError> {
        let p = &self.placement;
        p.check_sizes()?;
        if !p.judge.is_empty() && !self.uses_judge() {
            return bad(
                "placement.judge",
                format!("{:?}", p.judge),
                "places a judge, and no reward uses one (reward.kind = \"judge\" or a judge term): leave it empty",
            );
        }
        p.check_workers()
    }

    /// `[data]`, and what training from logs needs of `[algorithm]` and the pipeline.
    fn check_data(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        self.data.check(pipeline)?;
        self.check_rollouts(pipeline)?;
        self.data.check_template()
    }

    /// Training from logs: an importance correction to weigh rows of other
    /// policies, and single responses (neither episodes nor ReMax's greedy
    /// rows are replayed).
    fn check_rollouts(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        let d = &self.data;
        if d.rollouts.is_empty() || !pipeline.is_rl() {
            return Ok(());
        }
        let value = format!("{:?}", d.rollouts);
        if self.algorithm.correction == CorrectionChoice::None && self.algorithm.rejection.is_none()
        {
            return bad(
                "data.rollouts",
                value,
                "logged rows were sampled by other policies, by any number of versions: set algorithm.correction (tis, icepop, seq-mask, seq-tis, seq-icepop, geo-rejection, k3-rejection, binary-kl, tv, …) or algorithm.rejection to weigh them",
            );
        }
        if pipeline == PipelineKind::Remax {
            return bad(
                "data.rollouts",
                value,
                "remax's baseline is a greedy response generated beside each group, which a log does not hold",
            );
        }
        if self.agent.enabled() {
            return bad(
                "data.rollouts",
                value,
                "episodes ([agent]) are not replayed from logs yet",
            );
        }
        Ok(())
    }

    /// `[reward]`, with GDPO's terms, the reward model it needs and an
    /// overlong buffer below `generate.max_new_tokens`.
    fn check_reward(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        if self.algorithm.gdpo && self.reward.kind != RewardKind::Terms {
            return bad(
                "algorithm.gdpo",
                "true".into(),
                &format!(
                    "GDPO normalises each reward term on its own: it needs reward.kind = \"terms\" (not {:?})",
                    self.reward.kind
                ),
            );
        }
        self.reward.check()?;
        if self.reward.kind == RewardKind::Model && self.model.reward_model.is_none() {
            return bad(
                "model.reward_model",
                "\"\"".into(),
                "reward.kind = \"model\" needs a reward model",
            );
        }
        self.reward.check_sources()?;
        if self.reward.overlong_buffer >= self.generate.max_new_tokens && pipeline.is_rl() {
            return bad(
                "reward.overlong_buffer",
                self.reward.overlong_buffer.to_string(),
                &format!(
                    "must be below generate.max_new_tokens = {}",
                    self.generate.max_new_tokens
                ),
            );
        }
        Ok(())
    }

    /// `[eval]`, with a best checkpoint only where the evaluated policies are saved.
    fn check_eval(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        self.eval.check_prompts(pipeline)?;
        let (every, saves) = (self.eval.every, self.run.checkpoint_every);
        if self.eval.best_checkpoint && (saves == 0 || !every.is_multiple_of(saves)) {
            return bad(
                "eval.best_checkpoint",
                "true".into(),
                &format!(
                    "eval.every = {every} must be a multiple of run.checkpoint_every = {saves} (> 0), so that the evaluated policies are saved"
                ),
            );
        }
        self.eval.check_sizes()
    }

    /// `[lora]`, with adapter dropout only without gradient checkpointing.
    fn check_lora(&self) -> Result<(), ConfigError> {
        self.lora.check()?;
        if let Some(adapters) = self.lora.adapters() {
            if adapters.dropout > 0.0 && self.algorithm.gradient_checkpointing {
                return bad(
                    "lora.dropout",
                    adapters.dropout.to_string(),
                    "needs algorithm.gradient_checkpointing = false (a recomputed layer would draw other dropout masks)",
                );
            }
        }
        Ok(())
    }

    /// `[algorithm]`'s updates, with mini-batches that a step's rows fill.
    fn check_updates(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        let a = &self.algorithm;
        a.check_passes()?;
        let rows = self.data.prompts_per_step * self.data.samples_per_prompt;
        if pipeline.is_rl() && (a.mini_batches == 0 || a.mini_batches > rows) {
            return bad(
                "algorithm.mini_batches",
                a.mini_batches.to_string(),
                &format!("must be in 1..={rows} (the rows of a step: prompts_per_step × samples_per_prompt)"),
            );
        }
        a.check_updates(pipeline)
    }

    /// `[dynamic_sampling]`, with the steps it waits for within
    /// `run.max_staleness` and a target that `data.prompts_per_step` can reach.
    fn check_dynamic_sampling(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        self.dynamic_sampling.check(pipeline)?;
        let (target, extra) = (
            self.dynamic_sampling.target_groups,
            self.dynamic_sampling.max_extra_batches,
        );
        if self.dynamic_sampling.enabled && extra > self.run.max_staleness {
            // The steps it waits for are generated before it trains only
            // as far as the bound lets generation run ahead.
            return bad(
                "dynamic_sampling.max_extra_batches",
                extra.to_string(),
                &format!(
                    "is more than run.max_staleness = {}: a step can wait only for the steps \
                     generated before it trains",
                    self.run.max_staleness
                ),
            );
        }
        let reach = self
            .data
            .prompts_per_step
            .saturating_mul(1 + extra as usize);
        if self.dynamic_sampling.enabled && target > reach {
            // The pool only keeps a step's surplus over the target: past the
            // prompts it may draw on, every step would fall short.
            return bad(
                "dynamic_sampling.target_groups",
                target.to_string(),
                &format!(
                    "is more than the {reach} prompts a step may draw on (data.prompts_per_step = \
                     {} × (1 + dynamic_sampling.max_extra_batches)); oversample with more prompts \
                     per step",
                    self.data.prompts_per_step
                ),
            );
        }
        Ok(())
    }
}

/// Why the checkpoint in `scorer` (`role`, e.g. "the reference") cannot
/// score the token ids of the policy in `policy`, in a sentence: its
/// vocabulary (`config.json`'s `vocab_size`, which may pad past the
/// tokenizer's) stops short of the policy's, or its tokenizer reads an id
/// of the policy's as another token ([`weir_gpu::Tokenizer::id_difference`]:
/// ids of its own past the policy's are fine). `None` when it can, or when
/// a folder does not load (the checks that load it name that); an error
/// when its tokenizer.json is there and does not load.
pub(crate) fn unread_policy_ids(
    policy: &std::path::Path,
    scorer: &std::path::Path,
    role: &str,
) -> Result<Option<String>, String> {
    use weir_gpu::{ModelConfig, Tokenizer};
    let (Ok(ours), Ok(theirs)) = (ModelConfig::load(policy), ModelConfig::load(scorer)) else {
        return Ok(None);
    };
    if theirs.vocab_size < ours.vocab_size {
        return Ok(Some(format!(
            "its config.json has vocab_size {}, the policy's ({}) {}: {role} could not score a sampled id past {}",
            theirs.vocab_size,
            policy.display(),
            ours.vocab_size,
            theirs.vocab_size - 1
        )));
    }
    let file = |dir: &std::path::Path| std::fs::read(dir.join("tokenizer.json")).ok();
    let theirs_file = file(scorer);
    if theirs_file.is_none() || theirs_file == file(policy) {
        return Ok(None);
    }
    let theirs =
        Tokenizer::load(scorer).map_err(|e| format!("its tokenizer does not load: {e}"))?;
    let Ok(ours) = Tokenizer::load(policy) else {
        return Ok(None);
    };
    Ok(ours.id_difference(
        &format!("the policy's tokenizer ({})", policy.display()),
        &theirs,
        &format!("{role}'s"),
    ))
}
