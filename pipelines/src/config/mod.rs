//! Typed run configs: TOML with `deny_unknown_fields`, a documented default
//! for every key (the [`KEYS`] table, which `weir config` prints), and
//! validation that names the key and the bad value.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use weir_gpu::{SamplingParams, Tokenizer};

use crate::PipelineKind;

mod agent;
mod choices;
mod docs;
mod scope;
pub(crate) mod text;
mod validate;

use text::none_if_empty;

pub use choices::{
    Aggregation, Backend, CorrectionChoice, DeviceChoice, DistillTask, Dtype, Flavor, GkdTail,
    JudgeVerdict, KlEstimator, OnError, OnNewWeights, OnUnparsed, PolicyLossChoice,
    PreferenceChoice, PythonNetwork, ReferencePlacement, RewardKind, RolloutAdvantages,
    ScheduleChoice, TeacherPlacement, ToolFormat, WeightsChannelChoice,
};

/// A whole run config.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Steps, staleness, seed, threads, checkpoints.
    pub run: RunSection,
    /// Which workers run which roles.
    pub placement: PlacementSection,
    /// Checkpoints of the roles.
    pub model: ModelSection,
    /// The prompt set.
    pub data: DataSection,
    /// Sampling.
    pub generate: GenerateSection,
    /// Where rewards come from.
    pub reward: RewardSection,
    /// Loss, optimizer, estimator settings.
    pub algorithm: AlgorithmSection,
    /// DAPO's dynamic sampling.
    pub dynamic_sampling: DynamicSamplingSection,
    /// Skipping prompts by their statistics.
    pub curriculum: CurriculumSection,
    /// Greedy evaluation on the arith task.
    pub eval: EvalSection,
    /// LoRA adapters for the actor.
    pub lora: LoraSection,
    /// Multi-turn episodes with tools and environments.
    pub agent: AgentSection,
    /// The teacher of on-policy distillation.
    pub teacher: TeacherSection,
    /// A generative judge's reward (`reward.kind = "judge"`, or a term).
    pub judge: JudgeSection,
}

/// `[judge]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JudgeSection {
    /// The judge's HF checkpoint folder (a causal LM).
    pub path: PathBuf,
    /// The minijinja template of the judge's prompt.
    pub template: String,
    /// Give the rendered template to the judge as a user message through
    /// its tokenizer's chat template.
    pub chat: bool,
    /// How the judge's answer becomes the reward.
    pub verdict: JudgeVerdict,
    /// `verdict = "regex"`: the pattern whose first group is the reward.
    pub pattern: String,
    /// `verdict = "probability"`: the tokens whose probability is the reward.
    pub verdict_tokens: Vec<String>,
    /// Tokens the judge generates at most.
    pub max_new_tokens: usize,
    /// The judge's sampling temperature (0: greedy).
    pub temperature: f64,
    /// What an answer the pattern does not parse gets.
    pub on_unparsed: OnUnparsed,
    /// `on_unparsed = "reward"`: that reward.
    pub unparsed_reward: f64,
}

impl Default for JudgeSection {
    fn default() -> Self {
        JudgeSection {
            path: PathBuf::new(),
            template: "Question: {{ prompt }} Response: {{ response }} How good is the response, from 0 (wrong) to 10 (perfect)? Answer with the number only.".into(),
            chat: true,
            verdict: JudgeVerdict::Regex,
            pattern: r"(-?\d+(?:\.\d+)?)".into(),
            verdict_tokens: Vec::new(),
            max_new_tokens: 32,
            temperature: 0.0,
            on_unparsed: OnUnparsed::Error,
            unparsed_reward: 0.0,
        }
    }
}

/// `[teacher]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TeacherSection {
    /// The teacher's HF checkpoint folder (`distill`; required there).
    pub path: PathBuf,
    /// Tokens the teacher records at each position for a top-k loss term (0: none).
    pub top_k: usize,
}

/// `[run]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunSection {
    /// Steps (policy updates) to run.
    pub steps: u64,
    /// Bounded staleness k.
    pub max_staleness: u64,
    /// Seed of shuffling and sampling.
    pub seed: u64,
    /// libtorch threads per worker.
    pub threads: usize,
    /// Checkpoint every N steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Checkpoint weights above this size go in shards with an index (`5GB`, `500MB`, `2GiB`).
    pub max_shard_size: String,
    /// Rows per rollout Parquet file.
    pub rows_per_file: usize,
    /// `cpu` or `cuda`.
    pub device: DeviceChoice,
}

impl Default for RunSection {
    fn default() -> Self {
        RunSection {
            steps: 100,
            max_staleness: 1,
            seed: 42,
            threads: 1,
            checkpoint_every: 50,
            max_shard_size: "5GB".into(),
            rows_per_file: 4096,
            device: DeviceChoice::Cpu,
        }
    }
}

/// `[placement]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlacementSection {
    /// Engine workers (threads; one per GPU on a GPU machine).
    pub workers: usize,
    /// Workers that generate and score.
    pub rollout: Vec<usize>,
    /// Workers that run the critic, advantage and learner (several: data-parallel learner ranks).
    pub train: Vec<usize>,
    /// Where the reference runs: `train` or `rollout` (beside the generator).
    pub reference: ReferencePlacement,
    /// How the learner's weights cross to another process.
    pub weights_channel: WeightsChannelChoice,
    /// The port the direct channel's server listens on (0: any free one).
    pub weights_port: u16,
    /// The largest bucket, in MiB, the learner's weights cross to another
    /// process in over timely's channel.
    pub weights_bucket_mib: usize,
    /// Encrypt every byte between the processes of a cluster.
    pub encrypt: bool,
    /// Where the distillation teacher runs: `train`, `rollout` or workers of its own.
    pub teacher: TeacherPlacement,
    /// Shard the trainers' optimizer state over the data-parallel ranks (ZeRO stages 1 and 2).
    pub shard_optimizer: bool,
    /// Workers the judge reward runs on (empty: the rollout workers).
    pub judge: Vec<usize>,
}

impl Default for PlacementSection {
    fn default() -> Self {
        PlacementSection {
            workers: 2,
            rollout: vec![0],
            train: vec![1],
            reference: ReferencePlacement::Train,
            weights_channel: WeightsChannelChoice::Direct,
            weights_port: 0,
            weights_bucket_mib: 64,
            encrypt: false,
            teacher: TeacherPlacement::At(ReferencePlacement::Train),
            shard_optimizer: false,
            judge: Vec::new(),
        }
    }
}

/// `[model]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// The actor's HF checkpoint folder (required).
    pub path: PathBuf,
    /// Compute dtype: `f32`, `bf16`, `f16`.
    pub dtype: Dtype,
    /// The frozen reference (none: the actor's checkpoint).
    #[serde(with = "none_if_empty")]
    pub reference: Option<PathBuf>,
    /// A reward model checkpoint, for `reward.kind = "model"`.
    #[serde(with = "none_if_empty")]
    pub reward_model: Option<PathBuf>,
    /// The critic's initial checkpoint (ppo; none: the reward model, else the actor with a fresh head).
    #[serde(with = "none_if_empty")]
    pub critic: Option<PathBuf>,
}

impl ModelSection {
    /// The frozen reference's checkpoint: `reference`, else the actor's.
    pub fn reference_dir(&self) -> &PathBuf {
        self.reference.as_ref().unwrap_or(&self.path)
    }
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            path: PathBuf::new(),
            dtype: Dtype::F32,
            reference: None,
            reward_model: None,
            critic: None,
        }
    }
}

/// `[data]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// `arith` (the built-in task) or a `.jsonl` / `.parquet` prompt file.
    pub prompts: Task,
    /// The column holding plain-text prompts (file prompt sets).
    pub prompt_column: String,
    /// The column holding chat messages instead (none: use `prompt_column`).
    #[serde(with = "none_if_empty")]
    pub messages_column: Option<String>,
    /// The column with the reference answer (rule rewards, SFT targets).
    #[serde(with = "none_if_empty")]
    pub label_column: Option<String>,
    /// A text in which `{prompt}` stands for each plain-text prompt.
    #[serde(with = "none_if_empty")]
    pub prompt_template: Option<String>,
    /// Render plain-text prompts with the model's chat template, as a user message.
    pub apply_chat_template: bool,
    /// A system message put before every chat prompt.
    #[serde(with = "none_if_empty")]
    pub system_prompt: Option<String>,
    /// Prompts per step.
    pub prompts_per_step: usize,
    /// Samples per prompt (the group size).
    pub samples_per_prompt: usize,
    /// Passes over the prompts (0: as many as the steps need).
    pub epochs: u64,
    /// The preferred response's column (rm, dpo).
    pub chosen_column: String,
    /// The dispreferred response's column (rm, dpo).
    pub rejected_column: String,
    /// A column with each pair's reward margin (rm).
    #[serde(with = "none_if_empty")]
    pub margin_column: Option<String>,
    /// Leave out prompts too long for the context beside
    /// `generate.max_new_tokens` (false: such a prompt is an error).
    pub skip_long_prompts: bool,
    /// Rollout logs to train on: run folders, folders of log files, or
    /// files (empty: every row is generated).
    pub rollouts: Vec<PathBuf>,
    /// A row filter on the logs (`step >= 10 and reward > 0`; empty: every row).
    #[serde(with = "none_if_empty")]
    pub rollouts_where: Option<String>,
    /// The share of each step's groups replayed from the logs (1: all).
    pub replay_fraction: f64,
    /// Replayed rows' advantages: computed again from their logged rewards,
    /// or taken as logged.
    pub rollout_advantages: RolloutAdvantages,
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            prompts: Task::Arith,
            prompt_column: "prompt".into(),
            messages_column: None,
            label_column: Some("answer".into()),
            prompt_template: None,
            apply_chat_template: false,
            system_prompt: None,
            prompts_per_step: 8,
            samples_per_prompt: 8,
            epochs: 0,
            chosen_column: "chosen".into(),
            rejected_column: "rejected".into(),
            margin_column: None,
            skip_long_prompts: false,
            rollouts: Vec::new(),
            rollouts_where: None,
            replay_fraction: 1.0,
            rollout_advantages: RolloutAdvantages::Recompute,
        }
    }
}

/// A task: what `data.prompts` names (its prompt sets and measures live in
/// `crate::task`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum Task {
    /// The built-in arith task.
    Arith,
    /// A prompt file.
    File(PathBuf),
}

/// `[generate]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GenerateSection {
    /// Most new tokens per response.
    pub max_new_tokens: usize,
    /// Sampling temperature.
    pub temperature: f64,
    /// Nucleus sampling (1.0: off).
    pub top_p: f64,
    /// Top-k sampling (0: off).
    pub top_k: usize,
    /// Streaming generation: sequences in flight at most, across batches
    /// and steps (0: batch by batch).
    pub max_inflight: usize,
    /// What in-flight sequences do when new weights arrive.
    pub on_new_weights: OnNewWeights,
    /// A long-tail workload: per-response token budgets from a Pareto
    /// distribution of this shape, eos ignored (0: off).
    pub long_tail: f64,
    /// Generate every response to `max_new_tokens`, past the end tokens (a
    /// throughput setting, as TRL's `suppress_tokens` of the eos id;
    /// evaluation still stops at them).
    pub ignore_eos: bool,
    /// Which runtime decodes: `auto` or `torch`.
    pub backend: Backend,
}

impl Default for GenerateSection {
    fn default() -> Self {
        GenerateSection {
            max_new_tokens: 8,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_inflight: 0,
            on_new_weights: OnNewWeights::Finish,
            long_tail: 0.0,
            ignore_eos: false,
            backend: Backend::Auto,
        }
    }
}

impl GenerateSection {
    /// How the generator samples: these keys with the tokenizer's end tokens
    /// and the run's seed.
    pub fn sampling(&self, tok: &Tokenizer, seed: u64) -> SamplingParams {
        SamplingParams {
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            top_p: (self.top_p < 1.0).then_some(self.top_p),
            top_k: (self.top_k > 0).then_some(self.top_k),
            eos_token_ids: tok.eos_token_ids().to_vec(),
            seed,
            ignore_eos: self.ignore_eos,
            ..Default::default()
        }
    }
}

/// `[reward]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardSection {
    /// `rule`, `model` or `remote`.
    pub kind: RewardKind,
    /// The rule's name (`reward.kind = "rule"`).
    pub rule: String,
    /// The reward server (`reward.kind = "remote"`).
    #[serde(with = "none_if_empty")]
    pub url: Option<String>,
    /// PEM certificates of authorities an `https://` reward server may be
    /// signed by, beside the system's.
    #[serde(with = "none_if_empty")]
    pub ca_file: Option<PathBuf>,
    /// Seconds per request before a retry.
    pub timeout_s: f64,
    /// Attempts per request.
    pub attempts: u32,
    /// The Python file of `reward.kind = "python"`.
    #[serde(with = "none_if_empty")]
    pub file: Option<PathBuf>,
    /// Its function: OpenRLHF's `reward_func(queries, prompts, labels,
    /// **kwargs)`, or verl's per-sample `compute_score`.
    pub function: String,
    /// The interpreter that runs it.
    pub python: String,
    /// Worker processes running it.
    pub workers: usize,
    /// The rewards of `reward.kind = "terms"`, summed with their weights
    /// (kept last: TOML writes arrays of tables after the plain keys).
    pub terms: Vec<RewardTerm>,
    /// DAPO's overlong buffer in tokens below `generate.max_new_tokens` (0: off).
    pub overlong_buffer: usize,
    /// The overlong penalty at `generate.max_new_tokens`.
    pub overlong_penalty_factor: f64,
    /// ProRL's stop-properly coefficient on truncated responses (1.0: off).
    pub stop_properly_coef: f64,
    /// Rewards that replace a row's by its `finish_reason` (e.g. `length = 0.0`).
    pub on_finish: std::collections::BTreeMap<String, f64>,
}

impl Default for RewardSection {
    fn default() -> Self {
        RewardSection {
            kind: RewardKind::Rule,
            rule: "arith_exact_match".into(),
            url: None,
            ca_file: None,
            timeout_s: 60.0,
            attempts: 3,
            file: None,
            function: "reward_func".into(),
            python: "python3".into(),
            workers: 2,
            terms: Vec::new(),
            overlong_buffer: 0,
            overlong_penalty_factor: 1.0,
            stop_properly_coef: 1.0,
            on_finish: Default::default(),
        }
    }
}

/// One `[[reward.terms]]` entry: a rule or a Python function, with a weight.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardTerm {
    /// Its metric is `reward_<name>` (default: the rule, or the function).
    #[serde(with = "none_if_empty")]
    pub name: Option<String>,
    /// A rule: `arith_exact_match`, `math`, `exact`, `contains`, `regex`, `length`.
    #[serde(with = "none_if_empty")]
    pub rule: Option<String>,
    /// Or a Python file (OpenRLHF's or verl's signature, as `reward.file`).
    #[serde(with = "none_if_empty")]
    pub file: Option<PathBuf>,
    /// The Python file's function.
    pub function: String,
    /// Its weight in the sum.
    pub weight: f64,
    /// The `regex` rule's pattern, matched against the whole completion.
    pub pattern: String,
    /// The `length` rule's length at which the penalty reaches −1 (0: generate.max_new_tokens).
    pub max_tokens: usize,
}

impl Default for RewardTerm {
    fn default() -> Self {
        RewardTerm {
            name: None,
            rule: None,
            file: None,
            function: "reward_func".into(),
            weight: 1.0,
            pattern: String::new(),
            max_tokens: 0,
        }
    }
}

impl RewardTerm {
    /// The name its metric carries.
    pub fn label(&self) -> String {
        self.name
            .clone()
            .or_else(|| self.rule.clone())
            .unwrap_or_else(|| self.function.clone())
    }
}

/// `[algorithm]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlgorithmSection {
    /// Peak learning rate.
    pub lr: f64,
    /// The weight of distillation's per-token term in the advantage.
    pub distill_coef: f64,
    /// The task advantage distillation adds its term to.
    pub distill_task: DistillTask,
    /// GKD's β of the top-k distillation term.
    pub gkd_beta: f64,
    /// The weight of the top-k distillation term in the loss.
    pub gkd_coef: f64,
    /// The mass outside the teacher's top k.
    pub gkd_tail: GkdTail,
    /// Linear warm-up steps.
    pub warmup_steps: u64,
    /// `constant` or `cosine`.
    pub schedule: ScheduleChoice,
    /// The cosine floor as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// Gradient-norm clip (0: off).
    pub max_grad_norm: f64,
    /// Rows per forward/backward pass.
    pub micro_batch: usize,
    /// Padded tokens per forward/backward pass of the actor's learner, rows sorted by length (0: off).
    pub micro_batch_tokens: usize,
    /// Recompute layer activations in the backward pass (actor learner, SFT).
    pub gradient_checkpointing: bool,
    /// Run a micro-batch's rows end to end as one sequence (actor learner).
    pub packing: bool,
    /// Response positions the output head runs on at a time in log-prob passes (0: all at once).
    pub logprob_chunk: usize,
    /// Optimizer passes over each step's rows.
    pub ppo_epochs: usize,
    /// Optimizer steps per pass (the step's rows in this many mini-batches).
    pub mini_batches: usize,
    /// ε_low of the clipped ratio.
    pub clip_low: f64,
    /// ε_high (> clip_low: DAPO's clip-higher).
    pub clip_high: f64,
    /// Dual-clip c for negative advantages (0: off).
    pub dual_clip: f64,
    /// β of the KL to the reference (in the loss for group estimators, in the reward for ppo / reinforce_pp).
    pub kl_coef: f64,
    /// `k1`, `k2` (`mse`), `k3`, `abs`, `k1+`, `k3+`.
    pub kl_estimator: KlEstimator,
    /// The KL the adaptive controller steers the in-reward coefficient
    /// towards (0: `kl_coef` stays fixed).
    pub kl_target: f64,
    /// Responses over which the adaptive controller spreads a full adjustment.
    pub kl_horizon: f64,
    /// Entropy bonus coefficient.
    pub entropy_coef: f64,
    /// `token-mean`, `seq-mean-token-mean`, `seq-mean-token-sum`, `seq-mean-token-sum-norm`, `token-sum`.
    pub aggregation: Aggregation,
    /// T of `seq-mean-token-sum-norm` (0: `generate.max_new_tokens`, the padded response length).
    pub loss_scale_factor: f64,
    /// `ppo`, `gspo`, `cispo`, `sapo`, `gmpo`, `gpg`, `reinforce`, `clip_cov`, `kl_cov`.
    pub policy_loss: PolicyLossChoice,
    /// SAPO's τ for positive advantages.
    pub sapo_tau_pos: f64,
    /// SAPO's τ for other advantages.
    pub sapo_tau_neg: f64,
    /// Clip-Cov: the fraction of tokens whose gradient is cut.
    pub clip_cov_ratio: f64,
    /// Clip-Cov: the covariance's lower bound.
    pub clip_cov_lb: f64,
    /// Clip-Cov: the covariance's upper bound.
    pub clip_cov_ub: f64,
    /// KL-Cov: the fraction of tokens penalised.
    pub kl_cov_ratio: f64,
    /// KL-Cov: the penalty's coefficient.
    pub kl_cov_coef: f64,
    /// REINFORCE: the cap of its importance ratio to the behaviour policy.
    pub reinforce_is_cap: f64,
    /// DRO: β of the quadratic log-ratio penalty.
    pub dro_beta: f64,
    /// GDPO: each reward term normalised within its group on its own.
    pub gdpo: bool,
    /// `openrlhf` or `verl` semantics where they differ.
    pub flavor: Flavor,
    /// Discount γ (ppo's GAE, reinforce_pp's returns).
    pub gamma: f64,
    /// GAE's λ (ppo).
    pub lambda: f64,
    /// The critic's learning rate (ppo).
    pub critic_lr: f64,
    /// Value clipping (ppo; 0: off).
    pub value_clip: f64,
    /// β of the preference losses (dpo).
    pub beta: f64,
    /// `dpo`, `cdpo` or `ipo` (dpo).
    pub preference_loss: PreferenceChoice,
    /// ε of cDPO: the probability a preference label is flipped.
    pub label_smoothing: f64,
    /// Off-policy correction of stale rows (`CorrectionChoice`).
    pub correction: CorrectionChoice,
    /// The correction's lower bound on the importance ratio.
    pub correction_low: f64,
    /// The correction's upper bound.
    pub correction_high: f64,
    /// Divide the correction's weights by their mean over the step.
    pub correction_batch_normalize: bool,
    /// verl's rejection criteria, comma-separated (`token_k1,seq_max_k2`; none: off).
    #[serde(with = "none_if_empty")]
    pub rejection: Option<String>,
    /// Their thresholds, one shared or one per criterion (`0.5_2.0,0.01`).
    pub rejection_threshold: String,
    /// The KL loss term's gradient as OpenRLHF's `unbiased_gradient`.
    pub kl_unbiased_gradient: bool,
}

impl Default for AlgorithmSection {
    fn default() -> Self {
        AlgorithmSection {
            lr: 1e-4,
            distill_coef: 1.0,
            distill_task: DistillTask::None,
            gkd_beta: 0.5,
            gkd_coef: 1.0,
            gkd_tail: GkdTail::Add,
            warmup_steps: 0,
            schedule: ScheduleChoice::Constant,
            min_lr_ratio: 0.1,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            micro_batch: 64,
            micro_batch_tokens: 0,
            gradient_checkpointing: false,
            packing: false,
            logprob_chunk: 1024,
            ppo_epochs: 1,
            mini_batches: 1,
            clip_low: 0.2,
            clip_high: 0.2,
            dual_clip: 0.0,
            kl_coef: 0.04,
            kl_estimator: KlEstimator::K3,
            kl_target: 0.0,
            kl_horizon: 10_000.0,
            entropy_coef: 0.0,
            aggregation: Aggregation::TokenMean,
            loss_scale_factor: 0.0,
            policy_loss: PolicyLossChoice::Ppo,
            sapo_tau_pos: 1.0,
            sapo_tau_neg: 1.05,
            clip_cov_ratio: 0.0002,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 0.0002,
            kl_cov_coef: 0.1,
            reinforce_is_cap: 2.0,
            dro_beta: 0.05,
            gdpo: false,
            flavor: Flavor::OpenRlhf,
            gamma: 1.0,
            lambda: 1.0,
            critic_lr: 5e-5,
            value_clip: 0.5,
            beta: 0.1,
            preference_loss: PreferenceChoice::Dpo,
            label_smoothing: 0.0,
            correction: CorrectionChoice::None,
            correction_low: 0.0,
            correction_high: 2.0,
            correction_batch_normalize: false,
            rejection: None,
            rejection_threshold: "2.0".into(),
            kl_unbiased_gradient: false,
        }
    }
}

/// `[dynamic_sampling]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DynamicSamplingSection {
    /// Drop groups whose rewards all agree (DAPO).
    pub enabled: bool,
    /// Groups per step for the learner (0: every informative group); set
    /// `data.prompts_per_step` above it to oversample.
    pub target_groups: usize,
    /// How many later steps' prompts a step short of `target_groups` waits
    /// for (verl's extra generation batches; 0: it trains short), at most
    /// `run.max_staleness`.
    pub max_extra_batches: u64,
}

/// `[curriculum]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CurriculumSection {
    /// Skip prompts by their solve rate so far.
    pub enabled: bool,
    /// Samples a prompt needs before it is judged.
    pub min_samples: u64,
    /// Skip prompts solved at this rate or more.
    pub max_solve_rate: f64,
    /// Skip prompts solved at this rate or less (negative: keep all).
    pub min_solve_rate: f64,
    /// A sample counts as solved at this reward or more.
    pub solve_threshold: f64,
}

impl Default for CurriculumSection {
    fn default() -> Self {
        CurriculumSection {
            enabled: false,
            min_samples: 8,
            max_solve_rate: 1.0,
            min_solve_rate: -1.0,
            solve_threshold: 1.0,
        }
    }
}

/// `[eval]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSection {
    /// Greedy accuracy on the 500 arith evaluation pairs before and after (arith data only).
    pub arith: bool,
    /// Prompts per generation batch.
    pub batch: usize,
    /// Held-out prompts (a file like `data.prompts`) the final policy is evaluated on.
    #[serde(with = "none_if_empty")]
    pub prompts: Option<PathBuf>,
    /// Responses sampled per eval prompt for mean@k and pass@k (1: greedy only).
    pub k: usize,
    /// Evaluate on `prompts` every N steps during training, from step 0 (0: only at the end).
    pub every: u64,
    /// Mark the checkpoint of the best evaluation (`checkpoints/best`, `best.json`).
    pub best_checkpoint: bool,
}

impl Default for EvalSection {
    fn default() -> Self {
        EvalSection {
            arith: true,
            batch: 128,
            prompts: None,
            k: 1,
            every: 0,
            best_checkpoint: false,
        }
    }
}

/// `[lora]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraSection {
    /// Adapter rank (0: no adapters, the whole model trains).
    pub rank: i64,
    /// The adapters' update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// Dropout on the adapters' input while training.
    pub dropout: f64,
    /// The projections that get adapters.
    pub target_modules: Vec<String>,
}

impl Default for LoraSection {
    fn default() -> Self {
        LoraSection {
            rank: 0,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: weir_gpu::lora::TARGET_MODULES
                .iter()
                .map(|m| m.to_string())
                .collect(),
        }
    }
}

impl LoraSection {
    /// The adapters' shape, when `rank > 0`.
    pub fn adapters(&self) -> Option<weir_gpu::lora::LoraConfig> {
        (self.rank > 0).then(|| weir_gpu::lora::LoraConfig {
            rank: self.rank,
            alpha: self.alpha,
            dropout: self.dropout,
            target_modules: self.target_modules.clone(),
        })
    }
}

pub use agent::{AgentSection, FunctionTool, HttpToolSpec, ToolSpec};
pub use docs::{applies, reference_page, Key, Readers, KEYS};
pub(crate) use validate::unread_policy_ids;

/// A config error: the key and what is wrong with its value.
#[derive(Debug, thiserror::Error)]
#[error("{source_name}: {message}")]
pub struct ConfigError {
    /// The file (or `--set`).
    pub source_name: String,
    /// What is wrong.
    pub message: String,
}

impl RunConfig {
    /// Whether a `[judge]` scores the rows: `reward.kind = "judge"`, or a
    /// `[[reward.terms]]` entry with `rule = "judge"`.
    pub fn uses_judge(&self) -> bool {
        let r = &self.reward;
        r.kind == RewardKind::Judge
            || (r.kind == RewardKind::Terms
                && r.terms.iter().any(|t| t.rule.as_deref() == Some("judge")))
    }

    /// The code outside weir this config runs: a line per Python reward
    /// (its file, function and interpreter), what `--resume` shows first,
    /// since a run folder's config decides what runs.
    pub fn code_it_runs(&self) -> Vec<String> {
        let r = &self.reward;
        let line = |file: &PathBuf, function: &str| {
            format!(
                "Python {}:{function} with the interpreter `{}`",
                file.display(),
                r.python
            )
        };
        let mut lines = Vec::new();
        match r.kind {
            RewardKind::Python => lines.extend(r.file.iter().map(|f| line(f, &r.function))),
            RewardKind::Terms => lines.extend(
                r.terms
                    .iter()
                    .filter_map(|t| t.file.as_ref().map(|f| line(f, &t.function))),
            ),
            RewardKind::Rule
            | RewardKind::Model
            | RewardKind::Remote
            | RewardKind::None
            | RewardKind::Judge => {}
        }
        let a = &self.agent;
        if let Some(file) = a.environment_file() {
            lines.push(format!(
                "Python {file}:{} (agent.environment) with the interpreter `{}`",
                a.environment_class, a.python
            ));
        }
        for tool in &a.tools {
            match tool {
                agent::ToolSpec::Function(f) => lines.push(format!(
                    "Python {}:{} (agent.tools) with the interpreter `{}`",
                    f.file.display(),
                    f.function,
                    a.python
                )),
                agent::ToolSpec::Builtin(name) if name == "python" => lines.push(format!(
                    "the model's own Python code (agent.tools: python) with the interpreter `{}`{}",
                    a.python,
                    if a.python_network == PythonNetwork::Allow {
                        ", on the network (agent.python_network = \"allow\")"
                    } else {
                        ""
                    }
                )),
                agent::ToolSpec::Builtin(_) | agent::ToolSpec::Http(_) => {}
            }
        }
        lines
    }

    /// The defaults of `pipeline`.
    pub fn defaults_for(pipeline: PipelineKind) -> Self {
        let mut c = RunConfig::default();
        match pipeline {
            PipelineKind::Ppo => {
                c.algorithm.kl_coef = 0.01;
                c.algorithm.kl_estimator = KlEstimator::K1;
                c.data.samples_per_prompt = 1;
                c.data.prompts_per_step = 32;
                c.algorithm.lr = 1e-5;
            }
            // Dr.GRPO's length-unbiased loss: a constant normaliser, not each response's length.
            PipelineKind::DrGrpo => {
                c.algorithm.aggregation = Aggregation::SeqMeanTokenSumNorm;
            }
            // GPG trains with the plain policy gradient, as its paper and verl's recipe do.
            PipelineKind::Gpg => {
                c.algorithm.policy_loss = PolicyLossChoice::Gpg;
            }
            PipelineKind::ReinforcePp | PipelineKind::ReinforcePpBaseline => {
                c.algorithm.kl_coef = 0.01;
                c.algorithm.kl_estimator = KlEstimator::K1;
            }
            // verl's ReMax recipe: the KL in the reward, its estimator, its semantics.
            PipelineKind::Remax => {
                c.algorithm.kl_coef = 0.001;
                c.algorithm.kl_estimator = KlEstimator::K1;
                c.algorithm.flavor = Flavor::Verl;
            }
            PipelineKind::Sft | PipelineKind::Rm | PipelineKind::Dpo => {
                c.run.steps = 400;
                c.run.max_staleness = 0;
                c.placement = PlacementSection {
                    workers: 1,
                    rollout: vec![0],
                    train: vec![0],
                    ..PlacementSection::default()
                };
                c.data.prompts_per_step = 64;
                c.data.samples_per_prompt = 1;
                c.algorithm.lr = 1e-3;
                c.algorithm.warmup_steps = 100;
                c.algorithm.kl_coef = 0.0;
                if pipeline != PipelineKind::Sft {
                    c.run.steps = 200;
                    c.data.prompts_per_step = 32;
                    c.algorithm.lr = if pipeline == PipelineKind::Rm {
                        1e-4
                    } else {
                        1e-5
                    };
                    c.algorithm.warmup_steps = 10;
                }
            }
            // The group estimators and distillation keep the defaults above.
            PipelineKind::Distill
            | PipelineKind::Grpo
            | PipelineKind::Rloo
            | PipelineKind::Opo
            | PipelineKind::GrpoPassk
            | PipelineKind::Otb => {}
        }
        c
    }

    /// `pipeline`'s defaults, overlaid with the file's keys (if any), then with `--set` overrides.
    pub fn load(
        pipeline: PipelineKind,
        file: Option<(&str, &str)>,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let mut config = RunConfig::defaults_for(pipeline);
        if let Some((text, name)) = file {
            let err = |message: String| ConfigError {
                source_name: name.to_string(),
                message,
            };
            let user: toml::Table =
                toml::from_str(text).map_err(|e| err(e.to_string().trim().replace('\n', " ")))?;
            let mut doc = toml::Value::try_from(&config).map_err(|e| err(e.to_string()))?;
            for (section, value) in user {
                if section == "pipeline" {
                    // A file may say its pipeline (as config.resolved.toml does).
                    match value.as_str().map(PipelineKind::parse) {
                        Some(Ok(kind)) if kind == pipeline => continue,
                        Some(Ok(kind)) => {
                            return Err(err(format!(
                                "`pipeline` = {:?}, but the run is {:?}",
                                kind.name(),
                                pipeline.name()
                            )))
                        }
                        Some(Err(e)) => return Err(err(format!("`pipeline`: {e}"))),
                        None => return Err(err("`pipeline` must be a string".into())),
                    }
                }
                match (value, doc.get_mut(&section)) {
                    (toml::Value::Table(keys), Some(toml::Value::Table(base))) => {
                        base.extend(keys);
                    }
                    (_, Some(_)) => {
                        return Err(err(format!("`{section}` must be a table ([{section}])")))
                    }
                    (_, None) => return Err(err(format!("unknown section `{section}`"))),
                }
            }
            let merged = toml::to_string(&doc).map_err(|e| err(e.to_string()))?;
            config = RunConfig::from_toml(&merged, name)?;
        }
        config.with_overrides(overrides)
    }

    /// Parses TOML text (unknown keys, wrong types and values outside a
    /// key's choices are errors naming the key).
    pub fn from_toml(text: &str, source_name: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let key = e.span().and_then(|span| key_at(text, span.start));
            ConfigError {
                source_name: source_name.to_string(),
                message: match key {
                    Some(key) => format!("`{key}`: {}", e.message().trim()),
                    None => e.to_string().trim().replace('\n', " "),
                },
            }
        })
    }

    /// The pipeline a config file names with a top-level `pipeline = "…"`, if it does.
    pub fn pipeline_in(text: &str, source_name: &str) -> Result<Option<PipelineKind>, ConfigError> {
        let err = |message: String| ConfigError {
            source_name: source_name.to_string(),
            message,
        };
        let table: toml::Table =
            toml::from_str(text).map_err(|e| err(e.to_string().trim().replace('\n', " ")))?;
        match table.get("pipeline") {
            None => Ok(None),
            Some(v) => match v.as_str() {
                Some(name) => PipelineKind::parse(name)
                    .map(Some)
                    .map_err(|e| err(format!("`pipeline`: {e}"))),
                None => Err(err("`pipeline` must be a string".into())),
            },
        }
    }

    /// Applies `key=value` overrides (`section.key=value`, the value in TOML syntax; bare words are strings).
    pub fn with_overrides(self, overrides: &[String]) -> Result<Self, ConfigError> {
        let err = |message: String| ConfigError {
            source_name: "--set".into(),
            message,
        };
        let mut doc = toml::Value::try_from(&self).map_err(|e| err(e.to_string()))?;
        for item in overrides {
            let (key, raw) = item
                .split_once('=')
                .ok_or_else(|| err(format!("`{item}` is not key=value")))?;
            let (section, name) = key
                .trim()
                .split_once('.')
                .ok_or_else(|| err(format!("`{key}` is not section.key")))?;
            if docs::find(section, name).is_none() {
                return Err(err(format!("unknown key `{key}`")));
            }
            let raw = raw.trim();
            let value: toml::Value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
                .ok()
                .and_then(|t| t.get("v").cloned())
                .unwrap_or_else(|| toml::Value::String(raw.to_string()));
            doc[section][name] = value;
        }
        let text = toml::to_string(&doc).map_err(|e| err(e.to_string()))?;
        RunConfig::from_toml(&text, "--set")
    }

    /// The config as TOML: the keys `pipeline` reads ([`applies`]), each
    /// preceded by its documentation.
    pub fn to_commented_toml(&self, pipeline: PipelineKind) -> String {
        let doc = toml::Value::try_from(self).expect("a config serialises");
        let mut out = format!(
            "# weir run {} --config THIS_FILE\n# Every key is optional; shown are the defaults.\n",
            pipeline.name()
        );
        let mut section = "";
        for key in KEYS.iter().filter(|k| k.readers.read_by(pipeline)) {
            let (s, help) = (key.section, key.doc);
            if s != section {
                out.push_str(&format!("\n[{s}]\n"));
                section = s;
            }
            let value = &doc[s][key.name];
            let key = key.name;
            out.push_str(&format!("# {help}\n{key} = {value}\n"));
        }
        out
    }
}

/// The `section.key` whose line holds byte `offset` of `text`, if that
/// line is a `key = value` line under a `[section]` header.
fn key_at(text: &str, offset: usize) -> Option<String> {
    let start = text[..offset.min(text.len())]
        .rfind('\n')
        .map_or(0, |i| i + 1);
    let line = text[start..].lines().next()?;
    let (key, _) = line.split_once('=')?;
    let section = text[..start]
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix('[')?.strip_suffix(']'))?;
    Some(format!("{}.{}", section.trim(), key.trim()))
}

#[cfg(test)]
mod tests;
