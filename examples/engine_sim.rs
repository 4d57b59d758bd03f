//! The engine simulation as a cargo example:
//! `cargo run --release --example engine_sim -- --steps 20 --max-staleness 1 --workers 2 --out runs/sim`.
//! Same flags as `weir sim`; the last stdout line is `steps_per_s=<float>`.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "engine_sim",
    about = "weir's engine simulation: generate → score → advantage → learn"
)]
struct Args {
    #[command(flatten)]
    sim: weir::sim::SimArgs,
}

fn main() {
    let args = Args::parse();
    if let Err(err) = weir::sim::main_with(&args.sim) {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
