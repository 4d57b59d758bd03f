//! `weir run` and `weir config`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use weir_pipelines::runner::{read_resolved, RunRequest, RESOLVED};
use weir_pipelines::{PipelineKind, RunConfig};

/// `weir run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The pipeline: ppo, grpo, dr_grpo, rloo, opo, grpo_passk, gpg, otb,
    /// reinforce_pp, reinforce_pp_baseline, remax, distill, sft, rm or dpo.
    pub pipeline: Option<String>,
    /// A TOML config (`weir config PIPELINE` prints every key with its default).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Overrides, `section.key=value` (repeatable), applied after the file.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// The run folder (default: runs/PIPELINE-DATE-TIME).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue the run in this folder from its newest checkpoint.
    #[arg(long, value_name = "RUN_DIR", conflicts_with_all = ["pipeline", "config", "out"])]
    pub resume: Option<PathBuf>,
    /// No progress: neither the bar (on a terminal) nor the line a step
    /// that a run prints on stderr where it is no terminal (a log file).
    #[arg(long)]
    pub quiet: bool,
    /// The processes of the run: `placement.workers` is split evenly over
    /// them, and the run folder must be one that every process sees.
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
}

/// `weir config`.
#[derive(clap::Args, Debug)]
pub struct ConfigArgs {
    /// The pipeline whose default config to print.
    #[arg(required_unless_present = "reference")]
    pub pipeline: Option<String>,
    /// Print the configuration reference instead: every key of every
    /// pipeline, in Markdown (docs/configuration.md).
    #[arg(long, conflicts_with = "pipeline")]
    pub reference: bool,
}

/// Prints the commented default config of a pipeline, or the reference.
pub fn config(args: &ConfigArgs) -> anyhow::Result<()> {
    let Some(name) = args.pipeline.as_deref().filter(|_| !args.reference) else {
        print!("{}", weir_pipelines::config::reference_page());
        return Ok(());
    };
    let kind = PipelineKind::parse(name).map_err(anyhow::Error::msg)?;
    print!("{}", RunConfig::defaults_for(kind).to_commented_toml(kind));
    Ok(())
}

/// Runs or resumes a pipeline and prints where everything went.
pub fn run(args: &RunArgs) -> anyhow::Result<()> {
    let cluster = args.cluster.cluster()?;
    let request = if let Some(dir) = &args.resume {
        let (kind, cfg) = read_resolved(dir)?;
        let cfg = cfg.with_overrides(&args.set)?;
        // The run folder decides what runs: say so before anything does.
        for code in cfg.code_it_runs() {
            eprintln!("resume: {} runs {code}", dir.join(RESOLVED).display());
        }
        RunRequest {
            pipeline: kind,
            config: cfg,
            run_dir: dir.clone(),
            resume: true,
            progress: !args.quiet,
            cluster: cluster.clone(),
        }
    } else {
        let text = match &args.config {
            Some(path) => Some(
                weir_durable::read_text_capped(path, weir_durable::SIDE_FILE_BYTES)
                    .with_context(|| format!("reading the config {}", path.display()))?,
            ),
            None => None,
        };
        let source = args
            .config
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        // The pipeline named on the command line, else by the file's `pipeline` key.
        let kind = match (&args.pipeline, &text) {
            (Some(name), _) => PipelineKind::parse(name).map_err(anyhow::Error::msg)?,
            (None, Some(text)) => RunConfig::pipeline_in(text, &source)?.ok_or_else(|| {
                anyhow::anyhow!(
                    "{source}: name a pipeline (weir run grpo --config {source}, or pipeline = \"grpo\" in the file)"
                )
            })?,
            (None, None) => {
                bail!("name a pipeline (weir run grpo --config FILE.toml) or --resume RUN_DIR")
            }
        };
        if cluster.processes > 1 && args.out.is_none() {
            bail!("with --processes {}, name the run folder with --out: every process writes to the same one", cluster.processes);
        }
        let cfg = RunConfig::load(
            kind,
            text.as_deref().map(|t| (t, source.as_str())),
            &args.set,
        )?;
        RunRequest {
            pipeline: kind,
            config: cfg,
            run_dir: args
                .out
                .clone()
                .unwrap_or_else(|| default_run_dir(kind.name())),
            resume: false,
            progress: !args.quiet,
            cluster: cluster.clone(),
        }
    };
    let outcome = weir_pipelines::run(&request)?;
    if let Some(note) = &outcome.note {
        println!("{note}");
    }
    if !cluster.is_leader() {
        println!(
            "process {} of {}: done; process 0 writes the summary and plots",
            cluster.process, cluster.processes
        );
        println!("run folder: {}", outcome.run_dir.display());
        return Ok(());
    }
    print_summary(&outcome.summary);
    if outcome.run_dir.join("metrics.parquet").is_file() {
        let plots = crate::report::plot(&outcome.run_dir)?;
        println!("plots: {}", plots.len());
    } else {
        println!("plots: none (the run folder has no metrics.parquet)");
    }
    println!("run folder: {}", outcome.run_dir.display());
    Ok(())
}

/// A few lines of a run's summary.
pub fn print_summary(summary: &serde_json::Value) {
    for key in [
        "pipeline",
        "steps",
        "wall_s",
        "samples_per_s",
        "max_staleness_observed",
        "reward_first",
        "reward_last",
        "loss_first",
        "loss_last",
        "eval_accuracy_before",
        "eval_accuracy_after",
        "eval_reward",
        "eval_mean_at_k",
        "eval_pass_at_k",
    ] {
        match &summary[key] {
            serde_json::Value::Null => {}
            serde_json::Value::Number(n) if n.is_f64() => {
                println!("{key}: {:.4}", n.as_f64().unwrap_or(0.0))
            }
            v => println!("{key}: {v}"),
        }
    }
    if let Some(best) = summary["best_checkpoint"].as_object() {
        println!(
            "best checkpoint: {} (eval reward {} at step {})",
            best["checkpoint"].as_str().unwrap_or("?"),
            best["reward"],
            best["eval_step"]
        );
    }
}

/// `runs/NAME-YYYYMMDD-HHMMSS` under the current folder (UTC), made unique.
pub fn default_run_dir(name: &str) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    let stamp = format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    );
    let base = Path::new("runs").join(format!("{name}-{stamp}"));
    let mut dir = base.clone();
    let mut n = 1;
    while dir.exists() {
        dir = PathBuf::from(format!("{}-{n}", base.display()));
        n += 1;
    }
    dir
}

/// The proleptic Gregorian date of a day count since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    #[test]
    fn dates_from_day_counts() {
        assert_eq!(super::civil_from_days(0), (1970, 1, 1));
        assert_eq!(super::civil_from_days(20_786), (2026, 11, 29));
        assert_eq!(super::civil_from_days(11_016), (2000, 2, 29));
    }
}
