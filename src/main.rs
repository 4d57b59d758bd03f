//! The `weir` command line.

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
    /// Run the engine simulation (synthetic stages, real rows, Parquet output).
    Sim(weir::sim::SimArgs),
    /// Per-token log-probs of token sequences (JSONL `{"input_ids": [...]}` → Parquet).
    Logprobs(weir::model_cli::ModelArgs),
    /// Generate completions (JSONL `input_ids`, `prompt` or `messages` → Parquet).
    Generate(weir::model_cli::GenerateArgs),
    /// Score sequences with a reward model (JSONL → Parquet `score`).
    Score(weir::model_cli::ModelArgs),
    /// List the devices weir can place roles on (CPU, and CUDA devices with free/total memory).
    Devices,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("WEIR_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Sim(args) => weir::sim::main_with(args),
        Command::Logprobs(args) => weir::model_cli::logprobs(args),
        Command::Generate(args) => weir::model_cli::generate(args),
        Command::Score(args) => weir::model_cli::score(args),
        Command::Devices => weir::model_cli::devices(),
    };
    if let Err(err) = result {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
