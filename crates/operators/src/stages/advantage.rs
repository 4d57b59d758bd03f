//! `GroupAdvantage`: group-relative advantages (GRPO, Dr.GRPO, RLOO) over
//! whole prompt groups. Rows of one group may arrive in several batches
//! (from several generators); the stage keeps a step's rows and computes at
//! `end_step`, so its input edge must be partitioned `ByKey("group_id")`.

use arrow::array::{AsArray, RecordBatch};

use weir_gpu::collective::{leads, sum_scalars, GroupMember};
use weir_graph::batch::with_column;
use weir_graph::{StageError, StepBuffer, StepContext, StepStage};

use crate::algorithms::{greedy_baselines, grpo, grpo_passk, opo, remax, rloo, Flavor};
use crate::data::columns::{float_lists, rewards, u64s};
use crate::rollout::col;

/// Which group baseline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupEstimator {
    /// `(r − mean) / (std + ε)`.
    Grpo,
    /// `r − mean`.
    DrGrpo,
    /// `r − mean of the others`.
    Rloo,
    /// `r − the length-weighted mean` ([`crate::algorithms::opo`]).
    Opo,
    /// Pass@k: the best response gets `r_max − r_second`, scaled by the
    /// group's std ([`crate::algorithms::grpo_passk`]).
    PassK,
    /// GPG: `α (r − mean)` ([`crate::algorithms::gpg`]; α counts the
    /// stage's rows, the step's when it trains on one worker).
    Gpg,
    /// A baseline per position of the group's generated tokens, weighted
    /// by each path's accumulated variance
    /// ([`crate::algorithms::optimal_token_baseline`]); reads the
    /// generator's `sum_pi_squared`.
    OptimalTokenBaseline,
}

/// Computes `advantages` (the group-relative advantage on every response
/// token) and `returns` (the same, as outcome-only estimators define them).
pub struct GroupAdvantage {
    estimator: GroupEstimator,
    flavor: Flavor,
    /// The range each advantage is clipped to under OpenRLHF's flavor:
    /// OpenRLHF clips the shaped reward of its own group estimators (GRPO,
    /// Dr.GRPO, RLOO) to its reward clip range, ±10 by default; verl clips
    /// nothing.
    pub reward_clip: Option<(f64, f64)>,
    held: StepBuffer,
    data_parallel: Option<GroupMember>,
    /// GDPO: the reward terms' weights ([`GroupAdvantage::with_gdpo`]).
    gdpo: Option<Vec<f64>>,
}

impl GroupAdvantage {
    /// An advantage stage.
    pub fn new(estimator: GroupEstimator, flavor: Flavor) -> Self {
        let openrlhf_estimator = matches!(
            estimator,
            GroupEstimator::Grpo | GroupEstimator::DrGrpo | GroupEstimator::Rloo
        );
        GroupAdvantage {
            estimator,
            flavor,
            reward_clip: openrlhf_estimator.then_some((-10.0, 10.0)),
            held: super::rows_in_order(),
            data_parallel: None,
            gdpo: None,
        }
    }

    /// GDPO (verl 0.9's `gdpo` estimator, [`crate::algorithms::gdpo`]):
    /// each term of `reward_terms` normalised within its group on its own
    /// (by the std under GRPO, centred only under Dr.GRPO), summed with
    /// `weights` (an episode's environment rewards, if any, one more term
    /// of weight 1), and whitened over the step's generated tokens, all
    /// under verl's semantics. With data-parallel ranks the whitening is the
    /// whole step's. The estimator's own baseline is not used.
    pub fn with_gdpo(mut self, weights: Vec<f64>) -> Self {
        self.gdpo = Some(weights);
        self
    }

    /// One rank of the step's train workers: GPG's α counts the whole
    /// step's scores (the other estimators need only whole groups). Must
    /// run offloaded (it waits for its peers).
    pub fn with_data_parallel(mut self, member: GroupMember) -> Self {
        self.data_parallel = Some(member);
        self
    }

    /// GPG's α over the whole step, this rank's `rewards` among them.
    fn gpg_alpha(&self, rewards: &[f64]) -> Result<f64, StageError> {
        let (total, nonzero) = crate::algorithms::gpg_counts(rewards);
        let mut counts = [total, nonzero];
        sum_scalars(self.data_parallel.as_ref(), &mut counts)?;
        Ok(crate::algorithms::gpg_alpha(counts[0], counts[1]))
    }
}

impl StepStage for GroupAdvantage {
    fn buffer(&mut self) -> &mut StepBuffer {
        &mut self.held
    }

    fn run_step(
        &mut self,
        ctx: &mut StepContext,
        rows: Option<RecordBatch>,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let gpg_ranks = self.estimator == GroupEstimator::Gpg && self.data_parallel.is_some();
        let Some(batch) = rows else {
            if gpg_ranks {
                // A rank with no rows still joins the step's counts.
                self.gpg_alpha(&[])?;
            }
            if self.gdpo.is_some() && self.data_parallel.is_some() {
                // … and the step's whitening.
                whiten(&[], &[], Flavor::Verl, self.data_parallel.as_ref())?;
            }
            return Ok(Vec::new());
        };
        let mut rewards = rewards(&batch, ctx.stage())?;
        let groups = u64s(&batch, col::GROUP_ID, ctx.stage())?;
        let lengths: Vec<usize> = float_lists(&batch, col::BEHAVIOR_LOGPROBS, ctx.stage())?
            .iter()
            .map(Vec::len)
            .collect();
        // An episode's environment rewards count toward its reward.
        let env = crate::data::columns::env_rewards(&batch, &lengths, ctx.stage())?;
        if let Some(turns) = &env {
            for (r, turn) in rewards.iter_mut().zip(turns) {
                *r += turn.iter().sum::<f64>();
            }
        }
        if let Some(weights) = &self.gdpo {
            let per_token = self.gdpo_advantages(ctx, &batch, weights, &lengths, env)?;
            return Ok(vec![with_advantages(&batch, &per_token)?]);
        }
        if self.estimator == GroupEstimator::OptimalTokenBaseline {
            let stage = ctx.stage();
            if batch.column_by_name(col::SUM_PI_SQUARED).is_none() {
                return Err(format!(
                    "stage `{stage}`: the optimal token baseline needs the generator's `{}` column",
                    col::SUM_PI_SQUARED
                )
                .into());
            }
            let squares = float_lists(&batch, col::SUM_PI_SQUARED, stage)?;
            // An episode's observation tokens hold null log-probs, off the mask.
            let logprobs = float_lists(&batch, col::BEHAVIOR_LOGPROBS, stage)?;
            let masks = crate::data::columns::generated_masks(&batch, &lengths, stage)?;
            let per_token = crate::algorithms::optimal_token_baseline(
                &rewards, &logprobs, &squares, &masks, &groups,
            )?;
            return Ok(vec![with_advantages(&batch, &per_token)?]);
        }
        let per_response = match self.estimator {
            GroupEstimator::Grpo => grpo(&rewards, &groups, true, self.flavor)?,
            GroupEstimator::DrGrpo => grpo(&rewards, &groups, false, self.flavor)?,
            GroupEstimator::Rloo => rloo(&rewards, &groups, self.flavor)?,
            GroupEstimator::Opo => {
                // OPO weighs each response by the tokens the model generated.
                let masks = crate::data::columns::generated_masks(&batch, &lengths, ctx.stage())?;
                opo(
                    &rewards,
                    &crate::data::columns::generated_counts(&masks),
                    &groups,
                )?
            }
            GroupEstimator::PassK => grpo_passk(&rewards, &groups, true)?,
            GroupEstimator::Gpg => {
                let alpha = self.gpg_alpha(&rewards)?;
                crate::algorithms::gpg_with_alpha(&rewards, &groups, alpha)?
            }
            GroupEstimator::OptimalTokenBaseline => unreachable!("per token, above"),
        };
        let per_token: Vec<Vec<f64>> = per_response
            .iter()
            .map(
                |&a| match self.reward_clip.filter(|_| self.flavor.clips_scores()) {
                    Some((lo, hi)) => a.clamp(lo, hi),
                    None => a,
                },
            )
            .zip(&lengths)
            .map(|(a, n)| vec![a; *n])
            .collect();
        Ok(vec![with_advantages(&batch, &per_token)?])
    }
}

impl GroupAdvantage {
    /// GDPO's per-token advantages of `batch` ([`GroupAdvantage::with_gdpo`]).
    fn gdpo_advantages(
        &self,
        ctx: &StepContext,
        batch: &RecordBatch,
        weights: &[f64],
        lengths: &[usize],
        env: Option<Vec<Vec<f64>>>,
    ) -> Result<Vec<Vec<f64>>, StageError> {
        let stage = ctx.stage();
        if batch.column_by_name(col::REWARD_TERMS).is_none() {
            return Err(format!(
                "stage `{stage}`: GDPO (algorithm.gdpo) normalises each reward term on its own: \
                 it needs reward.kind = \"terms\" (the column `{}`)",
                col::REWARD_TERMS
            )
            .into());
        }
        let mut terms = float_lists(batch, col::REWARD_TERMS, stage)?;
        let mut weights = weights.to_vec();
        if let Some(turns) = env {
            weights.push(1.0);
            for (row, turn) in terms.iter_mut().zip(turns) {
                row.push(turn.iter().sum());
            }
        }
        if let Some(row) = terms.iter().position(|t| t.len() != weights.len()) {
            return Err(format!(
                "stage `{stage}`: row {row} has {} reward terms, the config {}",
                terms[row].len(),
                weights.len()
            )
            .into());
        }
        let groups = u64s(batch, col::GROUP_ID, stage)?;
        let by_std = self.estimator != GroupEstimator::DrGrpo;
        let masks = crate::data::columns::generated_masks(batch, lengths, stage)?;
        let member = self.data_parallel.as_ref();
        crate::algorithms::advantages::gdpo_over(&terms, &weights, &groups, &masks, by_std, |xs| {
            sum_scalars(member, xs).map_err(StageError::from)
        })
    }
}

/// `batch` with `per_token` as its advantages and its returns (outcome-only
/// estimators define them alike).
fn with_advantages(batch: &RecordBatch, per_token: &[Vec<f64>]) -> Result<RecordBatch, StageError> {
    let batch = with_column(
        batch,
        col::ADVANTAGES,
        crate::data::columns::float_list_array(per_token),
    )?;
    Ok(with_column(
        &batch,
        col::RETURNS,
        crate::data::columns::float_list_array(per_token),
    )?)
}

/// ReMax's split of a step's rows: each group's baseline from its greedy
/// row (`greedy_baseline`); the sampled rows alone, with the baseline as
/// `reward_baseline` and without the flag column.
fn split_greedy(
    ctx: &mut StepContext,
    batch: &RecordBatch,
) -> Result<(RecordBatch, Vec<f64>), StageError> {
    let scores = rewards(batch, ctx.stage())?;
    let groups = u64s(batch, col::GROUP_ID, ctx.stage())?;
    let greedy: arrow::array::BooleanArray = batch
        .column_by_name(col::GREEDY_BASELINE)
        .and_then(|c| c.as_boolean_opt().cloned())
        .ok_or_else(|| {
            format!(
                "advantage: ReMax needs the bool column `{}` (the prompt source's greedy rows)",
                col::GREEDY_BASELINE
            )
        })?;
    let flags: Vec<bool> = greedy.iter().map(|v| v.unwrap_or(false)).collect();
    let baselines = greedy_baselines(&scores, &groups, &flags)?;
    let greedy_scores: Vec<f64> = (0..flags.len())
        .filter(|&i| flags[i])
        .map(|i| scores[i])
        .collect();
    if !greedy_scores.is_empty() {
        ctx.record(
            "reward_baseline",
            greedy_scores.iter().sum::<f64>() / greedy_scores.len() as f64,
        );
    }
    let column = arrow::array::Float32Array::from_iter_values(baselines.iter().map(|b| *b as f32));
    let batch = with_column(batch, col::REWARD_BASELINE, std::sync::Arc::new(column))?;
    let sampled = arrow::compute::not(&greedy).map_err(|e| e.to_string())?;
    let mut kept =
        arrow::compute::filter_record_batch(&batch, &sampled).map_err(|e| e.to_string())?;
    let at = kept
        .schema()
        .index_of(col::GREEDY_BASELINE)
        .map_err(|e| e.to_string())?;
    kept.remove_column(at);
    let kept_baselines = (0..flags.len())
        .filter(|&i| !flags[i])
        .map(|i| baselines[i])
        .collect();
    Ok((kept, kept_baselines))
}

/// PPO's advantages: per-token rewards (the score on the last token, minus
/// `kl_coef ·` KL(behaviour ‖ reference) on every token, score clipped to
/// `reward_clip`), then GAE with the critic's `values`, then whitening over
/// the step's rows. Writes `token_rewards`, `advantages` and `returns`.
pub struct GaeAdvantage {
    /// Discount.
    pub gamma: f64,
    /// GAE λ.
    pub lambda: f64,
    /// β of the KL penalty in the reward (0: none; needs `ref_logprobs` otherwise).
    pub kl_coef: f64,
    /// Moves `kl_coef` after each step (`None`: fixed).
    pub adaptive_kl: Option<AdaptiveKl>,
    /// The KL estimator of the penalty.
    pub kl_estimator: crate::algorithms::KlEstimator,
    /// Clip range of the score (under OpenRLHF's flavor; verl clips nothing).
    pub reward_clip: Option<(f64, f64)>,
    /// Whiten the advantages over the step.
    pub whiten: bool,
    /// Whose semantics.
    pub flavor: Flavor,
    held: StepBuffer,
    data_parallel: Option<GroupMember>,
}

impl GaeAdvantage {
    /// OpenRLHF's defaults: γ = λ = 1, k1, score clipped to ±10, whitened.
    pub fn new(kl_coef: f64) -> Self {
        GaeAdvantage {
            gamma: 1.0,
            lambda: 1.0,
            kl_coef,
            adaptive_kl: None,
            kl_estimator: crate::algorithms::KlEstimator::K1,
            reward_clip: Some((-10.0, 10.0)),
            whiten: true,
            flavor: Flavor::OpenRlhf,
            held: super::rows_in_order(),
            data_parallel: None,
        }
    }

    /// One rank of the step's train workers: the whitening and the KL
    /// figures (and so the adaptive coefficient) are the whole step's, and
    /// rank 0 records them. Must run offloaded (it waits for its peers).
    pub fn with_data_parallel(mut self, member: GroupMember) -> Self {
        self.data_parallel = Some(member);
        self
    }
}

impl StepStage for GaeAdvantage {
    fn buffer(&mut self) -> &mut StepBuffer {
        &mut self.held
    }

    fn run_step(
        &mut self,
        ctx: &mut StepContext,
        rows: Option<RecordBatch>,
    ) -> Result<Vec<RecordBatch>, StageError> {
        use crate::algorithms::gae;
        let Some(batch) = rows else {
            join_without_rows(
                ctx,
                self.data_parallel.as_ref(),
                &mut self.kl_coef,
                self.adaptive_kl.as_ref(),
                self.whiten.then_some(self.flavor),
            )?;
            return Ok(Vec::new());
        };
        let scores = rewards(&batch, ctx.stage())?;
        let values = float_lists(&batch, col::VALUES, ctx.stage())?;
        let (rewards, mask, kl) = kl_shaped_rewards(
            ctx.stage(),
            &batch,
            &scores,
            self.kl_coef,
            self.kl_estimator,
            self.reward_clip,
            self.flavor,
        )?;
        record_kl(
            ctx,
            self.data_parallel.as_ref(),
            &mut self.kl_coef,
            self.adaptive_kl.as_ref(),
            &kl,
            &mask,
        )?;
        let (advantages, returns) = gae(
            &rewards,
            &values,
            &mask,
            self.gamma,
            self.lambda,
            self.flavor,
        );
        let advantages = if self.whiten {
            whiten(&advantages, &mask, self.flavor, self.data_parallel.as_ref())?
        } else {
            advantages
        };
        let batch = with_column(
            &batch,
            col::TOKEN_REWARDS,
            crate::data::columns::float_list_array(&rewards),
        )?;
        let batch = with_column(
            &batch,
            col::ADVANTAGES,
            crate::data::columns::float_list_array(&advantages),
        )?;
        let batch = with_column(
            &batch,
            col::RETURNS,
            crate::data::columns::float_list_array(&returns),
        )?;
        Ok(vec![batch])
    }
}

/// Rows of per-token values.
type TokenRows = Vec<Vec<f64>>;

/// Per-token rewards of a batch: `scores` on each response's last
/// generated token (clipped to `clip` under OpenRLHF's flavor) minus
/// `kl_coef ·` KL(behaviour ‖ reference) on every generated token; the
/// generated-token mask (all ones but an episode's observation and
/// boundary tokens, which carry no reward, no KL and no count); and the
/// per-token KL, zero off the mask (zero rows when the KL term is off).
fn kl_shaped_rewards(
    stage: &str,
    batch: &RecordBatch,
    scores: &[f64],
    kl_coef: f64,
    estimator: crate::algorithms::KlEstimator,
    clip: Option<(f64, f64)>,
    flavor: Flavor,
) -> Result<(TokenRows, TokenRows, TokenRows), StageError> {
    use crate::algorithms::{kl_tokens, token_rewards};
    let clip = clip.filter(|_| flavor.clips_scores());
    let behaviour = float_lists(batch, col::BEHAVIOR_LOGPROBS, stage)?;
    let lengths: Vec<usize> = behaviour.iter().map(Vec::len).collect();
    let mask = crate::data::columns::generated_masks(batch, &lengths, stage)?;
    let kl = if kl_coef > 0.0 {
        let reference = float_lists(batch, col::REF_LOGPROBS, stage)?;
        let mut kl = kl_tokens(&behaviour, &reference, estimator, flavor);
        for (row, m) in kl.iter_mut().zip(&mask) {
            for (k, m) in row.iter_mut().zip(m) {
                *k *= m;
            }
        }
        kl
    } else {
        mask.iter().map(|r| vec![0.0; r.len()]).collect()
    };
    let mut rewards = token_rewards(scores, &kl, &mask, kl_coef, clip);
    // An environment's turn rewards, each on its turn's last generated token.
    if let Some(turns) = crate::data::columns::env_rewards(batch, &lengths, stage)? {
        for (row, turn) in rewards.iter_mut().zip(turns) {
            for (r, t) in row.iter_mut().zip(turn) {
                *r += t;
            }
        }
    }
    Ok((rewards, mask, kl))
}

/// The KL figures of a step split over `member`'s ranks (or alone): the
/// token mean of `kl` (the KL these pipelines put in the reward, not in
/// the loss), the mean over responses of each response's token mean (what
/// the adaptive controller steers, as verl's `apply_kl_penalty` and
/// OpenRLHF compute it) and the number of responses. Every rank calls it,
/// with or without rows.
fn kl_figures(
    member: Option<&GroupMember>,
    kl: &[Vec<f64>],
    mask: &[Vec<f64>],
) -> Result<(f64, f64, f64), StageError> {
    use crate::algorithms::stats::masked_mean;
    // [Σ m·kl, Σ m, Σ per-response means, responses], in masked_mean's order.
    let mut sums = [0.0; 4];
    for (k, m) in kl.iter().zip(mask) {
        for (x, w) in k.iter().zip(m) {
            sums[0] += x * w;
            sums[1] += w;
        }
        sums[2] += masked_mean(std::slice::from_ref(k), std::slice::from_ref(m));
        sums[3] += 1.0;
    }
    sum_scalars(member, &mut sums)?;
    let token_mean = if sums[1] == 0.0 {
        0.0
    } else {
        sums[0] / sums[1]
    };
    Ok((token_mean, sums[2] / sums[3].max(1.0), sums[3]))
}

/// Whitening over the whole step, its rows split over `member`'s ranks (or alone).
fn whiten(
    advantages: &[Vec<f64>],
    mask: &[Vec<f64>],
    flavor: Flavor,
    member: Option<&GroupMember>,
) -> Result<TokenRows, StageError> {
    crate::algorithms::whiten_advantages_over(advantages, mask, false, flavor, |xs| {
        sum_scalars(member, xs)
    })
    .map_err(StageError::from)
}

/// A data-parallel rank with no rows this step still joins the step's
/// sums: the KL figures, and the whitening when `whitening` names its flavor.
fn join_without_rows(
    ctx: &mut StepContext,
    member: Option<&GroupMember>,
    kl_coef: &mut f64,
    adaptive: Option<&AdaptiveKl>,
    whitening: Option<Flavor>,
) -> Result<(), StageError> {
    if member.is_none() {
        return Ok(());
    }
    record_kl(ctx, member, kl_coef, adaptive, &[], &[])?;
    if let Some(flavor) = whitening {
        whiten(&[], &[], flavor, member)?;
    }
    Ok(())
}

/// With the KL term on: records the step's `kl` and `kl_coef` (on rank 0
/// of a group) and moves an adaptive coefficient, from the whole step's figures.
fn record_kl(
    ctx: &mut StepContext,
    member: Option<&GroupMember>,
    kl_coef: &mut f64,
    adaptive: Option<&AdaptiveKl>,
    kl: &[Vec<f64>],
    mask: &[Vec<f64>],
) -> Result<(), StageError> {
    if *kl_coef <= 0.0 {
        return Ok(());
    }
    let (token_mean, response_mean, responses) = kl_figures(member, kl, mask)?;
    if leads(member) {
        ctx.record("kl", token_mean);
        ctx.record("kl_coef", *kl_coef);
    }
    if let Some(adaptive) = adaptive {
        adaptive.update(ctx.step, kl_coef, response_mean, responses as usize);
    }
    Ok(())
}

/// The adaptive KL controller of an in-reward KL penalty (Ziegler et al.
/// 2019; OpenRLHF's and verl's `AdaptiveKLController`): after each step,
/// `β ← β · (1 + clip(KL / target − 1, −0.2, 0.2) · n / horizon)` with KL the
/// step's mean response KL and `n` its responses. Each new β is logged in
/// `values` (key `kl_coef`), so a checkpoint keeps it and a resume goes on from it.
#[derive(Clone, Debug)]
pub struct AdaptiveKl {
    /// The KL to steer towards.
    pub target: f64,
    /// Responses over which a full adjustment is spread.
    pub horizon: f64,
    /// Where each step's new coefficient is logged.
    pub values: Option<crate::checkpoint::StepValues>,
}

impl AdaptiveKl {
    /// Moves `coef` after step `step`, whose `responses` had mean KL `kl`.
    fn update(&self, step: u64, coef: &mut f64, kl: f64, responses: usize) {
        let mut controller = crate::algorithms::KlController::Adaptive {
            value: *coef,
            target: self.target,
            horizon: self.horizon,
        };
        controller.update(kl, responses as f64);
        *coef = controller.value();
        if let Some(values) = &self.values {
            values.record(step, "kl_coef", *coef);
        }
    }
}

/// REINFORCE++ (and, with `baseline`, REINFORCE++-baseline): scores minus
/// their group mean when `baseline`, KL-shaped per-token rewards, discounted
/// returns, advantages = the returns whitened over the step (OpenRLHF's
/// order: group shaping, reward clip + KL, returns, whitening). In verl's
/// flavor REINFORCE++-baseline follows verl's
/// `compute_reinforce_plus_plus_baseline_outcome_advantage`: each
/// response's total reward (score and KL penalty) minus its group's mean,
/// on every token, then whitened (no discount).
pub struct ReinforceAdvantage {
    /// The baseline (group mean and greedy need whole groups: `ByKey("group_id")`).
    pub baseline: ReinforceBaseline,
    /// Discount.
    pub gamma: f64,
    /// β of the KL penalty in the reward.
    pub kl_coef: f64,
    /// Moves `kl_coef` after each step (`None`: fixed).
    pub adaptive_kl: Option<AdaptiveKl>,
    /// The KL estimator.
    pub kl_estimator: crate::algorithms::KlEstimator,
    /// Clip range of the shaped score (under OpenRLHF's flavor; verl clips nothing).
    pub reward_clip: Option<(f64, f64)>,
    /// Whose semantics.
    pub flavor: Flavor,
    held: StepBuffer,
    data_parallel: Option<GroupMember>,
}

/// The baseline of [`ReinforceAdvantage`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReinforceBaseline {
    /// REINFORCE++: none; the returns are whitened over the step.
    None,
    /// REINFORCE++-baseline: the group mean subtracted from each score
    /// first; the returns are whitened.
    GroupMean,
    /// ReMax: the reward of the prompt's greedy response, subtracted from
    /// each token's (undiscounted) return ([`crate::algorithms::remax`]);
    /// no whitening. The greedy rows leave here.
    Greedy,
}

impl ReinforceAdvantage {
    /// OpenRLHF's defaults: γ = 1, k1, score clipped to ±10.
    pub fn new(baseline: ReinforceBaseline, kl_coef: f64) -> Self {
        ReinforceAdvantage {
            baseline,
            gamma: 1.0,
            kl_coef,
            adaptive_kl: None,
            kl_estimator: crate::algorithms::KlEstimator::K1,
            reward_clip: Some((-10.0, 10.0)),
            flavor: Flavor::OpenRlhf,
            held: super::rows_in_order(),
            data_parallel: None,
        }
    }

    /// One rank of the step's train workers: the whitening and the KL
    /// figures (and so the adaptive coefficient) are the whole step's, and
    /// rank 0 records them. Must run offloaded (it waits for its peers).
    pub fn with_data_parallel(mut self, member: GroupMember) -> Self {
        self.data_parallel = Some(member);
        self
    }
}

impl StepStage for ReinforceAdvantage {
    fn buffer(&mut self) -> &mut StepBuffer {
        &mut self.held
    }

    fn run_step(
        &mut self,
        ctx: &mut StepContext,
        rows: Option<RecordBatch>,
    ) -> Result<Vec<RecordBatch>, StageError> {
        use crate::algorithms::discounted_returns;
        let whitened = self.baseline != ReinforceBaseline::Greedy;
        let Some(batch) = rows else {
            join_without_rows(
                ctx,
                self.data_parallel.as_ref(),
                &mut self.kl_coef,
                self.adaptive_kl.as_ref(),
                whitened.then_some(self.flavor),
            )?;
            return Ok(Vec::new());
        };
        let (batch, greedy) = match self.baseline {
            ReinforceBaseline::Greedy => {
                let (batch, baselines) = split_greedy(ctx, &batch)?;
                (batch, Some(baselines))
            }
            ReinforceBaseline::None | ReinforceBaseline::GroupMean => (batch, None),
        };
        let mut scores = rewards(&batch, ctx.stage())?;
        // verl's REINFORCE++-baseline centres each response's whole return
        // (score and KL penalty) on its group's, and gives every token that.
        let verl_baseline =
            self.baseline == ReinforceBaseline::GroupMean && self.flavor == Flavor::Verl;
        if self.baseline == ReinforceBaseline::GroupMean && !verl_baseline {
            let groups = u64s(&batch, col::GROUP_ID, ctx.stage())?;
            scores = grpo(&scores, &groups, false, self.flavor)?;
        }
        let (rewards, mask, kl) = kl_shaped_rewards(
            ctx.stage(),
            &batch,
            &scores,
            self.kl_coef,
            self.kl_estimator,
            self.reward_clip,
            self.flavor,
        )?;
        record_kl(
            ctx,
            self.data_parallel.as_ref(),
            &mut self.kl_coef,
            self.adaptive_kl.as_ref(),
            &kl,
            &mask,
        )?;
        let (returns, advantages) = match &greedy {
            Some(baselines) => {
                let (advantages, returns) = remax(&rewards, &mask, baselines);
                (returns, advantages)
            }
            None if verl_baseline => {
                let groups = u64s(&batch, col::GROUP_ID, ctx.stage())?;
                let totals: Vec<f64> = rewards.iter().map(|r| r.iter().sum()).collect();
                let centred = grpo(&totals, &groups, false, self.flavor)?;
                let returns: TokenRows = centred
                    .iter()
                    .zip(&mask)
                    .map(|(&c, m)| vec![c; m.len()])
                    .collect();
                let member = self.data_parallel.as_ref();
                let advantages = whiten(&returns, &mask, self.flavor, member)?;
                (returns, advantages)
            }
            None => {
                let returns = discounted_returns(&rewards, &mask, self.gamma, self.flavor);
                let member = self.data_parallel.as_ref();
                let advantages = whiten(&returns, &mask, self.flavor, member)?;
                (returns, advantages)
            }
        };
        let batch = with_column(
            &batch,
            col::TOKEN_REWARDS,
            crate::data::columns::float_list_array(&rewards),
        )?;
        let batch = with_column(
            &batch,
            col::ADVANTAGES,
            crate::data::columns::float_list_array(&advantages),
        )?;
        let batch = with_column(
            &batch,
            col::RETURNS,
            crate::data::columns::float_list_array(&returns),
        )?;
        Ok(vec![batch])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{ArrayRef, AsArray, Float32Array, UInt64Array};
    use arrow::datatypes::Float32Type;
    use std::sync::Arc;
    use weir_graph::{Stage, WorkerInfo};

    fn batch() -> RecordBatch {
        RecordBatch::try_from_iter([
            (
                col::GROUP_ID,
                Arc::new(UInt64Array::from(vec![0, 0, 1, 1])) as ArrayRef,
            ),
            (
                col::REWARD,
                Arc::new(Float32Array::from(vec![1.0, 0.0, 1.0, 1.0])) as ArrayRef,
            ),
            (
                col::BEHAVIOR_LOGPROBS,
                crate::data::columns::float_list_array(&[
                    vec![-1.0, -1.0],
                    vec![-1.0],
                    vec![-1.0, -1.0, -1.0],
                    vec![-1.0],
                ]),
            ),
        ])
        .unwrap()
    }

    fn run(stage: &mut dyn Stage) -> RecordBatch {
        let mut ctx = StepContext::detached(0, WorkerInfo::single(), 0);
        assert!(
            stage.process(&mut ctx, batch()).unwrap().is_empty(),
            "held until the step ends"
        );
        stage.end_step(&mut ctx).unwrap().remove(0)
    }

    #[test]
    fn a_non_finite_reward_is_an_error_naming_its_row() {
        for bad in [f32::NAN, f32::INFINITY] {
            let good = batch();
            let mut columns = good.columns().to_vec();
            columns[1] = Arc::new(Float32Array::from(vec![1.0, 0.0, bad, 1.0]));
            let batch = RecordBatch::try_new(good.schema(), columns).unwrap();
            let err = rewards(&batch, "advantage").unwrap_err().to_string();
            assert!(err.contains("row 2") && err.contains("finite"), "{err}");
        }
        assert_eq!(
            rewards(&batch(), "advantage").unwrap(),
            vec![1.0, 0.0, 1.0, 1.0]
        );
    }

    #[test]
    fn reinforce_baseline_returns_are_the_shaped_score_and_advantages_are_whitened() {
        let out = run(&mut ReinforceAdvantage::new(
            ReinforceBaseline::GroupMean,
            0.0,
        ));
        let returns = float_lists(&out, col::RETURNS, "t").unwrap();
        // Scores minus group means: [0.5, −0.5, 0, 0]; γ = 1 so every token carries it.
        assert_eq!(
            returns,
            vec![vec![0.5, 0.5], vec![-0.5], vec![0.0, 0.0, 0.0], vec![0.0]]
        );
        let adv = out
            .column_by_name(col::ADVANTAGES)
            .unwrap()
            .as_list::<i32>();
        let all: Vec<f32> = (0..4)
            .flat_map(|i| adv.value(i).as_primitive::<Float32Type>().values().to_vec())
            .collect();
        let mean: f32 = all.iter().sum::<f32>() / all.len() as f32;
        assert!(mean.abs() < 1e-6, "whitened: mean {mean}");
    }

    #[test]
    fn group_advantage_puts_the_grpo_value_on_every_token() {
        let out = run(&mut GroupAdvantage::new(
            GroupEstimator::DrGrpo,
            Flavor::OpenRlhf,
        ));
        let adv = float_lists(&out, col::ADVANTAGES, "t").unwrap();
        assert_eq!(
            adv,
            vec![vec![0.5, 0.5], vec![-0.5], vec![0.0, 0.0, 0.0], vec![0.0]]
        );
    }

    /// `batch()` with other rewards (and, when given, reference log-probs).
    fn scored(rewards: [f32; 4], reference: Option<Vec<Vec<f64>>>) -> RecordBatch {
        let good = batch();
        let mut columns = good.columns().to_vec();
        columns[1] = Arc::new(Float32Array::from(rewards.to_vec()));
        let mut fields: Vec<_> = good.schema().fields().iter().cloned().collect();
        if let Some(reference) = reference {
            columns.push(crate::data::columns::float_list_array(&reference));
            fields.push(Arc::new(arrow::datatypes::Field::new(
                col::REF_LOGPROBS,
                columns.last().unwrap().data_type().clone(),
                true,
            )));
        }
        RecordBatch::try_new(Arc::new(arrow::datatypes::Schema::new(fields)), columns).unwrap()
    }

    fn run_on(stage: &mut dyn Stage, batch: RecordBatch) -> RecordBatch {
        let mut ctx = StepContext::detached(0, WorkerInfo::single(), 0);
        assert!(stage.process(&mut ctx, batch).unwrap().is_empty());
        stage.end_step(&mut ctx).unwrap().remove(0)
    }

    /// An episode's observation tokens carry no reward and no KL penalty:
    /// the score sits on the last token the model generated (row 0 ends
    /// with an observation), and the return runs through an interior
    /// observation without being reset (row 2) — verl#6376, slime#1370.
    #[test]
    fn an_episodes_score_sits_on_its_last_generated_token_and_returns_cross_observations() {
        use crate::rollout::TokenKind::{Generated, Observation};
        // k1 KL 0.5 on each of row 0's tokens; 0 elsewhere.
        let reference = vec![
            vec![-1.5, -1.5],
            vec![-1.0],
            vec![-1.0, -1.0, -1.0],
            vec![-1.0],
        ];
        let batch = scored([1.0, 0.0, 2.0, 1.0], Some(reference));
        let kinds = crate::data::columns::token_kinds_array(&[
            Some(vec![Generated, Observation]),
            None,
            Some(vec![Generated, Observation, Generated]),
            None,
        ]);
        let batch = with_column(&batch, col::TOKEN_KINDS, kinds).unwrap();
        for flavor in [Flavor::OpenRlhf, Flavor::Verl] {
            let mut stage = ReinforceAdvantage::new(ReinforceBaseline::None, 0.5);
            stage.flavor = flavor;
            let out = run_on(&mut stage, batch.clone());
            let rewards = float_lists(&out, col::TOKEN_REWARDS, "t").unwrap();
            // Row 0: 1 − 0.5 · 0.5 on its generated token, nothing on the observation.
            assert_eq!(rewards[0], vec![0.75, 0.0], "{flavor:?}");
            assert_eq!(rewards[2], vec![0.0, 0.0, 2.0], "{flavor:?}");
            let returns = float_lists(&out, col::RETURNS, "t").unwrap();
            assert_eq!(returns[0][0], 0.75, "{flavor:?}");
            assert_eq!((returns[2][0], returns[2][2]), (2.0, 2.0), "{flavor:?}");
        }
        // Without the kinds, row 0's score would sit on its observation.
        let mut stage = ReinforceAdvantage::new(ReinforceBaseline::None, 0.5);
        let plain = run_on(
            &mut stage,
            scored(
                [1.0, 0.0, 2.0, 1.0],
                Some(vec![
                    vec![-1.5, -1.5],
                    vec![-1.0],
                    vec![-1.0, -1.0, -1.0],
                    vec![-1.0],
                ]),
            ),
        );
        let rewards = float_lists(&plain, col::TOKEN_REWARDS, "t").unwrap();
        assert_eq!(rewards[0], vec![-0.25, 0.75]);
    }

    /// An environment's turn rewards join the per-token rewards where they
    /// sit, and the row's reward (summed) for the group estimators.
    #[test]
    fn environment_rewards_join_token_rewards_and_group_rewards() {
        let with_env = |batch: RecordBatch| {
            let env = crate::data::columns::float_list_array(&[
                vec![0.5, 0.0],
                vec![],
                vec![0.0, 0.0, 0.0],
                vec![0.0],
            ]);
            with_column(&batch, col::ENV_REWARDS, env).unwrap()
        };
        let mut stage = ReinforceAdvantage::new(ReinforceBaseline::None, 0.0);
        let plain = float_lists(&run_on(&mut stage, batch()), col::TOKEN_REWARDS, "t").unwrap();
        let mut stage = ReinforceAdvantage::new(ReinforceBaseline::None, 0.0);
        let out = run_on(&mut stage, with_env(batch()));
        let rewards = float_lists(&out, col::TOKEN_REWARDS, "t").unwrap();
        assert_eq!(rewards[0], vec![plain[0][0] + 0.5, plain[0][1]]);
        assert_eq!(rewards[1..], plain[1..]);
        // Group 0's rewards become [1.5, 0] instead of [1, 0]: Dr.GRPO's
        // centred values [0.75, −0.75].
        let mut stage = GroupAdvantage::new(GroupEstimator::DrGrpo, Flavor::OpenRlhf);
        let adv =
            float_lists(&run_on(&mut stage, with_env(batch())), col::ADVANTAGES, "t").unwrap();
        assert_eq!(adv[0], vec![0.75, 0.75]);
        assert_eq!(adv[1], vec![-0.75]);
    }

    /// OpenRLHF clips the shaped rewards of its group estimators to ±10
    /// (`compute_reward`'s `reward_clip_range`); verl does not clip.
    #[test]
    fn openrlhf_group_advantages_are_clipped_to_the_reward_range() {
        for (flavor, want) in [(Flavor::OpenRlhf, 10.0), (Flavor::Verl, 15.0)] {
            let mut stage = GroupAdvantage::new(GroupEstimator::DrGrpo, flavor);
            let out = run_on(&mut stage, scored([30.0, 0.0, 1.0, 1.0], None));
            let adv = float_lists(&out, col::ADVANTAGES, "t").unwrap();
            assert_eq!(adv[0], vec![want, want], "{flavor:?}");
            assert_eq!(adv[1], vec![-want], "{flavor:?}");
        }
    }

    /// verl's REINFORCE++-baseline centres each response's total reward,
    /// KL penalty included, on its group's: two responses whose score gap
    /// the KL penalty cancels get no advantage at all; OpenRLHF's order
    /// (centre the scores, then add the per-token penalty) gives them one.
    #[test]
    fn verl_reinforce_baseline_centres_the_whole_return() {
        // Behaviour log-probs are −1 everywhere; the reference makes row 0's
        // k1 KL 0.5 on each of its two tokens, every other row's 0.
        let reference = vec![
            vec![-1.5, -1.5],
            vec![-1.0],
            vec![-1.0, -1.0, -1.0],
            vec![-1.0],
        ];
        let advantages = |flavor| {
            let mut stage = ReinforceAdvantage::new(ReinforceBaseline::GroupMean, 1.0);
            stage.flavor = flavor;
            stage.reward_clip = None;
            let out = run_on(
                &mut stage,
                scored([1.0, 0.0, 1.0, 1.0], Some(reference.clone())),
            );
            float_lists(&out, col::ADVANTAGES, "t").unwrap()
        };
        let verl = advantages(Flavor::Verl);
        assert!(verl.iter().flatten().all(|a| a.abs() < 1e-6), "{verl:?}");
        let openrlhf = advantages(Flavor::OpenRlhf);
        assert!(
            openrlhf.iter().flatten().any(|a| a.abs() > 0.1),
            "{openrlhf:?}"
        );
    }
}
