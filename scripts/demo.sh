#!/usr/bin/env bash
# weir's main job on a fresh machine: set-up, a release build, and the demo:
# a tokenizer and a small Llama trained from scratch, SFT on arithmetic, then
# GRPO with max_staleness = 1 (generation and learning on different workers),
# greedy accuracy on the 500 evaluation pairs before and after, all on CPU.
# The run folder (runs/demo-DATE-TIME by default) is printed at the end.
# Extra arguments go to `weir demo` (e.g. --out runs/my-demo --grpo-steps 300).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
cargo build --release --quiet
./target/release/weir demo "$@"
