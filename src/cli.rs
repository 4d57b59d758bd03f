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
    },
    /// Write PNG charts of a run (reward, KL, entropy, loss, staleness, throughput, idle shares) to RUN_DIR/plots.
    Plot {
        /// The run folder (holds metrics.parquet).
        run_dir: PathBuf,
    },
}

/// Parses the command line and runs the command; exits 1 with one line on error.
pub fn main() {
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
        Command::Inspect { run_dir } => {
            crate::report::inspect(run_dir).map(|text| print!("{text}"))
        }
        Command::Plot { run_dir } => crate::report::plot(run_dir).map(|paths| {
            for path in paths {
                println!("{}", path.display());
            }
        }),
    };
    if let Err(err) = result {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
