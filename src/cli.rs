//! The `weir` command line, as a library function: a binary of your own
//! that registers its rewards (`weir::operators::rewards::register`) and
//! then calls [`main`] has every command of `weir`, its rewards included.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// weir: RLHF as a streaming dataflow graph.
#[derive(Parser)]
#[command(name = "weir", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The demo: train a tokenizer and a small Llama, SFT it on arithmetic, then async GRPO (CPU, minutes).
    Demo(crate::demo::DemoArgs),
    /// Run a pipeline from a TOML config (or resume a run folder).
    Run(crate::run_cli::RunArgs),
    /// Print a pipeline's default config, every key documented.
    Config(crate::run_cli::ConfigArgs),
    /// Run the engine simulation (synthetic stages, real rows, Parquet output).
    Sim(crate::sim::SimArgs),
    /// Per-token log-probs of token sequences (JSONL `{"input_ids": [...]}` → Parquet).
    Logprobs(crate::model_cli::ModelArgs),
    /// Generate completions (JSONL `input_ids`, `prompt` or `messages` → Parquet).
    Generate(crate::model_cli::GenerateArgs),
    /// Score sequences with a reward model (JSONL → Parquet `score`).
    Score(crate::model_cli::ModelArgs),
    /// Merge a LoRA adapter folder (PEFT layout) into its base model: a plain HuggingFace checkpoint.
    Merge(crate::model_cli::MergeArgs),
    /// List the devices weir can place roles on (CPU, and CUDA devices with free/total memory).
    Devices,
    /// Summarise a run folder in the terminal: steps, reward/KL sparklines, staleness, per-stage busy time.
    Inspect {
        /// The run folder (holds metrics.parquet).
        run_dir: PathBuf,
        /// Show one rollout row turn by turn instead, STEP:ROW (the row's
        /// place in the step, by group and sample): the model's tokens,
        /// boundaries and observations marked apart, its tool calls.
        #[arg(long, value_name = "STEP:ROW")]
        episode: Option<String>,
    },
    /// Replay a run's learner on its logged rows, from the checkpoint before the first step, and compare its metrics with the run's.
    Replay(crate::log_cli::ReplayArgs),
    /// Write a run's logged rows as an SFT file (best responses), DPO pairs (best and worst of a group) or a prompt file.
    Export(crate::log_cli::ExportArgs),
    /// Write PNG charts of a run (reward, KL, entropy, loss, staleness, throughput, idle shares) to RUN_DIR/plots.
    Plot {
        /// The run folder (holds metrics.parquet).
        run_dir: PathBuf,
    },
}

/// Parses the command line and runs the command; exits 1 with one line on error.
pub fn main() {
    // Before any thread starts: nothing weir runs may read the secret.
    crate::cluster::take_secret_from_environment();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("WEIR_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Demo(args) => crate::demo::demo(args),
        Command::Run(args) => crate::run_cli::run(args),
        Command::Config(args) => crate::run_cli::config(args),
        Command::Sim(args) => crate::sim::main_with(args),
        Command::Logprobs(args) => crate::model_cli::logprobs(args),
        Command::Generate(args) => crate::model_cli::generate(args),
        Command::Score(args) => crate::model_cli::score(args),
        Command::Merge(args) => crate::model_cli::merge(args),
        Command::Devices => crate::model_cli::devices(),
        Command::Inspect { run_dir, episode } => match episode {
            Some(spec) => crate::report::episode(run_dir, spec).map(|text| print!("{text}")),
            None => crate::report::inspect(run_dir).map(|text| print!("{text}")),
        },
        Command::Replay(args) => crate::log_cli::replay(args),
        Command::Export(args) => crate::log_cli::export(args),
        Command::Plot { run_dir } => crate::report::plot(run_dir).map(|paths| {
            for path in paths {
                println!("{}", path.display());
            }
        }),
    };
    if let Err(err) = result {
        eprintln!("error: {}", one_line(&err));
        exit_now(1);
    }
    exit_now(0);
}

/// Ends the process with `code` without running the exit handlers.
///
/// A run that fails may leave engine threads inside libtorch: a learner's
/// backward pass is not interrupted when a peer process dies, and its
/// thread is not joined. `exit` would run libtorch's static destructors
/// under that thread, which then fails in a torch call and panics ("Invalid
/// (backend, op) pair"), so a one-line error grew a panic's backtrace. And
/// those destructors, unregistering every operator, cost every command
/// about 0.15 s of CPU on its way out. Nothing weir writes waits for exit
/// handlers: its files are synced and closed before the command returns,
/// and only stdout's buffer is left.
fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit ends the process at once; nothing after it runs.
    unsafe { libc::_exit(code) }
}

/// `err` and its causes on one line, each said once: a cause whose text
/// the errors before it already hold (a stage's error inside the engine's
/// message about that stage) is not repeated.
pub fn one_line(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn an_error_and_its_causes_make_one_line_each_said_once() {
        let missing = std::io::Error::new(std::io::ErrorKind::NotFound, "reward.json is missing");
        let stage = weir_graph::GraphError::stage("score", Some(3), 0, Box::new(missing));
        let err = anyhow::Error::new(weir_pipelines::PipelineError::from(stage));
        let said = "stage `score` failed at step 3 on worker 0: reward.json is missing";
        assert_eq!(one_line(&err), said);
        let err = err.context("run folder runs/a");
        assert_eq!(one_line(&err), format!("run folder runs/a: {said}"));
    }
}
