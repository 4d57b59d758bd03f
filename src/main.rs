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
    };
    if let Err(err) = result {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
