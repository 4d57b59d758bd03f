//! Training from logs (`data.rollouts`): the logs checked before a run
//! starts, and their groups loaded for the actor's generator to replay
//! (`weir_operators::data::from_log`).

use std::sync::Arc;

use weir_operators::data::from_log::LoggedGroups;
use weir_operators::rollout_log::RowFilter;

use crate::config::RolloutAdvantages;
use crate::manifest::{Manifest, ModelHashes};
use crate::{PipelineError, PipelineKind, RunConfig};

/// Checks that each log of `data.rollouts` whose manifest names a
/// tokenizer names the policy's: token ids of another tokenizer mean other
/// text. (Its files are checked as [`logged_groups`] indexes them, before
/// the run folder is touched.)
pub fn check_logs(cfg: &RunConfig) -> Result<(), PipelineError> {
    if cfg.data.rollouts.is_empty() {
        return Ok(());
    }
    let ours = ModelHashes::tokenizer_sha256(&cfg.model.path)?;
    for source in &cfg.data.rollouts {
        if let Some((path, manifest)) = Manifest::find(source)? {
            let theirs = &manifest.policy;
            let tokenizer = (theirs.tokenizer_sha256 != ours).then_some((
                "tokenizer.json",
                &theirs.tokenizer_sha256,
                &ours,
            ));
            if let Some((what, a, b)) = tokenizer {
                return Err(format!(
                    "data.rollouts: {}: the log's {what} (sha256 {}, from {}) differs from model.path's (sha256 {}): its token ids would mean other text",
                    path.display(),
                    &a[..12.min(a.len())],
                    theirs.path.display(),
                    &b[..12.min(b.len())]
                )
                .into());
            }
        }
    }
    Ok(())
}

/// The most tokens a logged row may hold where the model's config names no
/// context (`max_position_embeddings`), and at most in any case.
pub const MAX_LOGGED_TOKENS: usize = 1 << 20;

/// The logged groups a run of `kind` with `cfg` replays, if it trains from logs.
pub fn logged_groups(
    kind: PipelineKind,
    cfg: &RunConfig,
) -> Result<Option<Arc<LoggedGroups>>, PipelineError> {
    let d = &cfg.data;
    if d.rollouts.is_empty() || !kind.is_rl() {
        return Ok(None);
    }
    let filter = match &d.rollouts_where {
        Some(text) => RowFilter::parse(text).map_err(|e| format!("data.rollouts_where: {e}"))?,
        None => RowFilter::default(),
    };
    let logged = d.rollout_advantages == RolloutAdvantages::Logged;
    // A logged row longer than the model's context cannot be trained on.
    let context = weir_gpu::ModelConfig::load(std::path::Path::new(&cfg.model.path))?
        .max_position_embeddings
        .map_or(MAX_LOGGED_TOKENS, |n| n.max(0) as usize);
    let groups = LoggedGroups::load(
        &d.rollouts,
        &filter,
        d.replay_fraction,
        logged,
        context.min(MAX_LOGGED_TOKENS),
    )?;
    // What a replayed row cannot be given again: the generator's Σπ².
    if kind == PipelineKind::Otb && !logged {
        let squares = weir_operators::rollout::col::SUM_PI_SQUARED;
        if let Some(path) = groups.file_without(squares) {
            return Err(format!(
                "data.rollouts: {}: no `{squares}` column, which the optimal token baseline (otb) needs for every row: only otb runs log it (or set data.rollout_advantages = \"logged\")",
                path.display()
            )
            .into());
        }
    }
    tracing::info!(
        groups = groups.len(),
        rows = groups.rows,
        "data.rollouts: replaying logged groups"
    );
    Ok(Some(Arc::new(groups)))
}
