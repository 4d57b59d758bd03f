//! The `weir` command line (see `weir::cli`).

fn main() {
    weir::cli::main()
}
