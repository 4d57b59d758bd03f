#!/usr/bin/env bash
# weir's main job on a fresh machine: set-up, a release build, and the run.
# Today the main job is the engine simulation (generate → score → advantage →
# learn with synthetic stages on 2 workers, k = 1); the RLHF demo replaces it.
# Extra arguments go to `weir sim` (e.g. --steps 50 --out runs/my-sim).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
cargo run --release --quiet -- sim "$@"
