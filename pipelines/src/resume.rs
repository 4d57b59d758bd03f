//! Setting a run folder in order for a resume: the config values a
//! checkpoint's meaning rests on (kept in `state.json`, checked again), the
//! folder a new run must not take over, the metric rows of earlier
//! segments, and what the resumed steps replace kept aside.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow::array::{AsArray, BooleanArray};
use arrow::compute::filter_record_batch;
use arrow::datatypes::UInt64Type;
use weir_graph::metrics::{batch_to_rows, MetricRow};
use weir_graph::parquet_log::{read_parquet_file, write_parquet_atomically};
use weir_operators::rollout::col;

use crate::{PipelineError, PipelineKind, RunConfig};

/// The file holding a run's resolved config.
pub const RESOLVED: &str = "config.resolved.toml";

/// The resolved config's text: `pipeline = "…"` then every section.
pub fn resolved_config_text(kind: PipelineKind, cfg: &RunConfig) -> String {
    let body = toml::to_string(cfg).expect("a config serialises");
    format!("pipeline = \"{}\"\n\n{body}", kind.name())
}

/// The config values a resumed run must keep: the checkpoint's weights,
/// prompt cursor and components mean something only under them. Other keys
/// (the number of steps, learning rate, logging, threads) may change.
pub fn resume_invariants(kind: PipelineKind, cfg: &RunConfig) -> BTreeMap<String, String> {
    let (m, d) = (&cfg.model, &cfg.data);
    // As the file spells them ("" for none).
    use crate::config::text::plain;
    [
        ("pipeline", kind.name().to_string()),
        ("model.path", m.path.to_string_lossy().into_owned()),
        ("model.reference", plain(&m.reference)),
        ("model.reward_model", plain(&m.reward_model)),
        ("model.critic", plain(&m.critic)),
        ("data.prompts", String::from(d.prompts.clone())),
        ("data.prompt_column", d.prompt_column.clone()),
        ("data.messages_column", plain(&d.messages_column)),
        ("run.seed", cfg.run.seed.to_string()),
    ]
    .into_iter()
    // Prompts left out for their length make the prompt set depend on
    // the room beside the responses.
    .chain(
        d.skip_long_prompts
            .then(|| {
                [
                    ("data.skip_long_prompts", "true".to_string()),
                    (
                        "generate.max_new_tokens",
                        cfg.generate.max_new_tokens.to_string(),
                    ),
                ]
            })
            .into_iter()
            .flatten(),
    )
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Refuses to resume from checkpoint `ck` under a config that changed what it means.
pub(crate) fn check_resumable(
    dir: &Path,
    ck: &Path,
    state: &weir_operators::checkpoint::CheckpointState,
    cfg: &RunConfig,
    now: &BTreeMap<String, String>,
) -> Result<(), PipelineError> {
    let name = ck.file_name().unwrap_or_default().to_string_lossy();
    for (key, was) in &state.invariants {
        let is = now.get(key).map(String::as_str).unwrap_or("");
        if is != was {
            return Err(format!(
                "cannot resume {}: `{key}` is {is:?} in {} but checkpoint {name} was made with {was:?}; \
                 put it back, or start a new run from {}",
                dir.display(),
                dir.join(RESOLVED).display(),
                ck.join("actor").display()
            )
            .into());
        }
    }
    if cfg.run.steps <= state.step {
        return Err(format!(
            "cannot resume {}: `run.steps` = {} but the run has reached step {} (checkpoint {name}); \
             a resume may only add steps",
            dir.display(),
            cfg.run.steps,
            state.step
        )
        .into());
    }
    Ok(())
}

/// Whether a run folder holds nothing a step wrote: only the resolved
/// config and empty folders, as a start that failed before its first step
/// leaves it (bad input found while the pipeline was built). A new run may
/// take such a folder over.
pub(crate) fn holds_no_steps(dir: &Path) -> bool {
    // Folders of folders only; the top one may also hold the config, and
    // `rollouts/` the log's manifest (both written before the first step).
    fn no_files(dir: &Path, top: bool) -> bool {
        let manifest = dir.file_name().is_some_and(|n| n == "rollouts");
        std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.flatten().all(|e| {
                (top && e.file_name() == RESOLVED)
                    || (manifest && e.file_name() == weir_operators::rollout_log::MANIFEST)
                    || (e.file_type().is_ok_and(|t| t.is_dir()) && no_files(&e.path(), false))
            })
        })
    }
    no_files(dir, true)
}

/// Refuses an existing, non-empty folder that is not a weir run (a new run
/// would mix its files with someone else's).
pub(crate) fn refuse_foreign_folder(dir: &Path) -> Result<(), PipelineError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    // Another process of the run may be making the cluster's secret here.
    let mut entries = entries
        .flatten()
        .filter(|e| !weir_graph::cluster_secret::is_secret_file(&e.file_name()));
    if entries.next().is_some() {
        return Err(format!(
            "--out {}: the folder exists, is not empty and holds no weir run ({RESOLVED}); \
             pick a new folder",
            dir.display()
        )
        .into());
    }
    Ok(())
}

/// Metric rows of steps ≤ `last_step` from an earlier segment.
pub(crate) fn prior_metrics(path: &Path, last_step: u64) -> Result<Vec<MetricRow>, PipelineError> {
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let mut rows = Vec::new();
    for batch in read_parquet_file(path)? {
        rows.extend(
            batch_to_rows(&batch)?
                .into_iter()
                .filter(|r| r.step <= last_step),
        );
    }
    Ok(rows)
}

/// Copies `path` (if present) to `superseded/NAME-<unix seconds>` beside it.
pub(crate) fn keep_aside(path: &Path) -> Result<(), PipelineError> {
    if !path.is_file() {
        return Ok(());
    }
    let dir = path.parent().unwrap_or(Path::new(".")).join("superseded");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let target = dir.join(format!("{stamp}-{name}"));
    weir_durable::copy(path, &target).map_err(|e| format!("{}: {e}", target.display()))?;
    Ok(())
}

/// Moves rollout files holding steps after `last_step` (every file when
/// there is no checkpoint) to `superseded/`, keeping their rows up to
/// `last_step` in a new file.
pub(crate) fn trim_rollouts(dir: &Path, last_step: Option<u64>) -> Result<(), PipelineError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    let paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    // Half-written files of the crash (never renamed into place) are no one's rows.
    for tmp in paths
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "tmp"))
    {
        match std::fs::remove_file(tmp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(format!("{}: {e}", tmp.display()).into())
            }
            _ => {}
        }
    }
    let mut files: Vec<PathBuf> = paths
        .into_iter()
        .filter(|p| p.extension().is_some_and(|x| x == "parquet"))
        .collect();
    files.sort();
    for path in files {
        let batches = read_parquet_file(&path)?;
        let mut kept = Vec::new();
        let mut later = false;
        for b in &batches {
            let steps = b
                .column_by_name(col::STEP)
                .ok_or_else(|| format!("{}: no `step` column", path.display()))?
                .as_primitive::<UInt64Type>();
            let keep: BooleanArray = steps
                .iter()
                .map(|s| s.map(|s| last_step.is_some_and(|last| s <= last)))
                .collect();
            later |= keep.true_count() < b.num_rows();
            let k = filter_record_batch(b, &keep).map_err(|e| e.to_string())?;
            if k.num_rows() > 0 {
                kept.push(k);
            }
        }
        if !later {
            continue;
        }
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        let superseded = dir.join("superseded");
        std::fs::create_dir_all(&superseded)
            .map_err(|e| format!("{}: {e}", superseded.display()))?;
        if let (false, Some(last)) = (kept.is_empty(), last_step) {
            let stem = name.trim_end_matches(".parquet");
            write_parquet_atomically(&dir.join(format!("{stem}-upto-{last}.parquet")), &kept)?;
        }
        std::fs::rename(&path, superseded.join(&name))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}
