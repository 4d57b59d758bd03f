//! The rollout log as a dataset: `weir replay` and `weir export`.

use std::path::PathBuf;

use anyhow::bail;
use weir_pipelines::export::{export as export_log, ExportKind, ExportRequest};
use weir_pipelines::replay::{replay as replay_run, ReplayRequest};

/// `weir replay`.
#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// The run folder (an RL pipeline's, with its rollouts and metrics).
    pub run_dir: PathBuf,
    /// The steps to replay and compare: `A..B` (both included), `A..`
    /// (to the log's last), or `A` alone (default: every logged step). The
    /// learner starts from the newest checkpoint before A and is fed every
    /// step from there.
    #[arg(long, value_name = "A..B")]
    pub steps: Option<String>,
    /// The largest difference that counts as equal, relative to
    /// max(1, |logged value|) (default: 0 on the CPU, 1e-3 on CUDA).
    #[arg(long)]
    pub tolerance: Option<f64>,
}

/// Replays a run's learner on its logged rows; fails when a metric differs.
pub fn replay(args: &ReplayArgs) -> anyhow::Result<()> {
    let (first, last) = match &args.steps {
        Some(spec) => parse_steps(spec)?,
        None => (None, None),
    };
    let request = ReplayRequest {
        run_dir: args.run_dir.clone(),
        first,
        last,
        tolerance: args.tolerance,
    };
    let report = replay_run(&request, |line| println!("{line}"))?;
    println!("{}", report.last_line());
    if let Some(difference) = report.first_difference {
        bail!("replay: the first metric that differs: {difference}");
    }
    Ok(())
}

/// `weir export`.
#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// A run folder, a folder of rollout Parquet files, or one file.
    pub source: PathBuf,
    /// What to write: `sft` (the best response of each prompt whose reward
    /// reaches --min-reward: prompt, response, reward), `dpo` (each group's
    /// best and worst response when they differ by more than --min-margin:
    /// prompt, chosen, rejected) or `prompts` (each prompt once, with its
    /// samples, mean and best reward; --unsolved: only those whose best
    /// reward misses --min-reward). The dataset's own columns (a reference
    /// answer) come along.
    #[arg(long = "as", value_name = "sft|dpo|prompts")]
    pub kind: String,
    /// A row filter on the log's numeric columns, conditions joined by
    /// `and`: e.g. `step >= 10 and policy_version > 2` (skips row groups
    /// that cannot match).
    #[arg(long = "where", value_name = "FILTER", default_value = "")]
    pub filter: String,
    /// The reward a response must reach (sft), or that a prompt's best
    /// response misses (prompts --unsolved).
    #[arg(long, default_value_t = 1.0)]
    pub min_reward: f64,
    /// How much more reward a pair's chosen response has than its rejected one (dpo).
    #[arg(long, default_value_t = 0.0)]
    pub min_margin: f64,
    /// prompts: only those no response solved.
    #[arg(long)]
    pub unsolved: bool,
    /// The file to write, `.jsonl` or `.parquet` (it must not exist).
    #[arg(long)]
    pub out: PathBuf,
}

/// Writes a log's rows as an SFT, DPO or prompt file and says how to read it.
pub fn export(args: &ExportArgs) -> anyhow::Result<()> {
    let request = ExportRequest {
        source: args.source.clone(),
        kind: ExportKind::parse(&args.kind).map_err(anyhow::Error::msg)?,
        filter: args.filter.clone(),
        min_reward: args.min_reward,
        min_margin: args.min_margin,
        unsolved: args.unsolved,
        out: args.out.clone(),
    };
    let report = export_log(&request)?;
    if let Some(note) = &report.note {
        eprintln!("warning: {note}");
    }
    if let Some(keys) = &report.read_with {
        println!("read it with: {}", keys.join(", "));
    }
    println!(
        "export: rows_read={} written={} out={}",
        report.rows_read,
        report.written,
        args.out.display()
    );
    Ok(())
}

/// `A..B`, `A..`, `..B` or `A` as the first and last step.
fn parse_steps(spec: &str) -> anyhow::Result<(Option<u64>, Option<u64>)> {
    let step = |text: &str| -> anyhow::Result<Option<u64>> {
        let text = text.trim();
        if text.is_empty() {
            return Ok(None);
        }
        match text.parse() {
            Ok(step) => Ok(Some(step)),
            Err(_) => bail!("--steps {spec:?}: `{text}` is not a step number (A..B, A.. or A)"),
        }
    };
    Ok(match spec.split_once("..") {
        Some((a, b)) => (step(a)?, step(b.trim_start_matches('='))?),
        None => {
            let one = step(spec)?;
            (one, one)
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn step_ranges_parse() {
        let p = super::parse_steps;
        assert_eq!(p("2..5").unwrap(), (Some(2), Some(5)));
        assert_eq!(p("2..=5").unwrap(), (Some(2), Some(5)));
        assert_eq!(p("3..").unwrap(), (Some(3), None));
        assert_eq!(p("..4").unwrap(), (None, Some(4)));
        assert_eq!(p("7").unwrap(), (Some(7), Some(7)));
        let err = p("a..5").unwrap_err().to_string();
        assert!(err.contains("`a` is not a step number"), "{err}");
    }
}
