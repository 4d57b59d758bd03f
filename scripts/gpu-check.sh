#!/usr/bin/env bash
# GPU acceptance in one command, for a machine with a CUDA device: set-up
# with the full CUDA torch (WEIR_TORCH=full), then, within about ten minutes,
#   1. the model commands' parity tests on CUDA (logprobs, generate, score
#      held to the float64 transformers references at the CPU tolerances,
#      and bf16 / f16 log-probs within the tolerances stated in
#      tests/cli/models.rs: bf16 ≤ 0.15 on any token and ≤ 0.03 on average;
#      the same tests, run with WEIR_TEST_DEVICE=cuda);
#   2. the NCCL weights edge's own test (a one-rank group broadcasts);
#   3. generation tokens/s on CUDA (`weir generate` on the arith fixture,
#      64 tokens per sample, end of sequence ignored), and the generation
#      bench on CUDA (`WEIR_BENCH_DEVICE=cuda cargo bench --bench
#      generation`: tokens/s of the random 24.6M Llama, forward+backward
#      tokens/s, and a long-tail pool against static batches);
#   4. a short `grpo` run with `run.device = "cuda"` (generator and learner
#      on different devices when two are present, else colocated);
#   5. the same run with LoRA adapters (`lora.rank = 8`): a PEFT folder;
#   6. with two devices, two data-parallel learner ranks, one per device
#      (their gradient all-reduce goes device to device);
# and a last line `gpu-check: passed=<n> failed=<n> [failed: <names>]`.
# Without a CUDA device it says so in one line and exits 0.
#
#   ./scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export WEIR_TORCH="${WEIR_TORCH:-full}"
./scripts/setup.sh >/dev/null || { echo "gpu-check: set-up failed (scripts/setup.sh)"; exit 1; }
cargo build --release --bin weir -q 2>/dev/null || { echo "gpu-check: the build failed (cargo build --release)"; exit 1; }
weir=target/release/weir

devices="$("$weir" devices 2>&1)"
count="$(printf '%s\n' "$devices" | sed -n 's/^libtorch sees \([0-9]*\) CUDA.*/\1/p')"
if [ "${count:-0}" -eq 0 ]; then
  reason="$(printf '%s\n' "$devices" | grep '^cuda' | head -1)"
  echo "gpu-check: no CUDA device here (${reason:-libtorch sees none}); nothing to check"
  exit 0
fi
echo "gpu-check: $count CUDA device(s)"
printf '%s\n' "$devices"

passed=0
failed=()
check() {
  local name="$1"
  shift
  echo "== $name"
  local started=$SECONDS
  if "$@"; then
    passed=$((passed + 1))
    echo "== $name: passed ($((SECONDS - started)) s)"
  else
    failed+=("$name")
    echo "== $name: FAILED ($((SECONDS - started)) s)"
  fi
}

fixtures="$(cd ../shared/fixtures/models && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

parity() {
  WEIR_TEST_DEVICE=cuda timeout 300 cargo test --release -q --test cli models:: 2>&1 | tail -5
  return "${PIPESTATUS[0]}"
}

nccl() {
  timeout 120 cargo test --release -q -p weir-gpu --lib nccl 2>&1 | tail -3
  return "${PIPESTATUS[0]}"
}

generation() {
  python3 - "$work/in.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(64):
        f.write(json.dumps({"messages": [{"role": "user", "content": f"Compute: {i}+{i % 7}"}]}) + "\n")
PY
  local started
  started=$(date +%s.%N)
  timeout 120 "$weir" generate --model "$fixtures/arith-sft" --input "$work/in.jsonl" --output "$work/gen.parquet" \
    --device cuda --max-new-tokens 64 --ignore-eos --batch-size 64 --seed 1 || return 1
  python3 -c "import sys; t = float(sys.argv[2]) - float(sys.argv[1]); print(f'generation: 64 × 64 tokens in {t:.2f} s, {4096 / t:.0f} tokens/s (with model loading)')" "$started" "$(date +%s.%N)"
}

generation_bench() {
  WEIR_BENCH_DEVICE=cuda timeout 300 cargo bench -q --bench generation 2>&1 | grep -v '^$' | tail -8
  return "${PIPESTATUS[0]}"
}

grpo() {
  local placement=(--set placement.workers=1 --set "placement.rollout=[0]" --set "placement.train=[0]")
  if [ "$count" -ge 2 ]; then
    placement=(--set placement.workers=2 --set "placement.rollout=[0]" --set "placement.train=[1]")
  fi
  timeout 300 "$weir" run grpo --quiet --out "$work/grpo" \
    --set "model.path=$fixtures/arith-sft" --set run.device=cuda --set run.steps=4 \
    --set data.prompts_per_step=8 --set data.samples_per_prompt=8 --set generate.max_new_tokens=8 \
    --set eval.arith=false "${placement[@]}" || return 1
  test -f "$work/grpo/checkpoints/step-3/actor/model.safetensors"
}

grpo_lora() {
  timeout 300 "$weir" run grpo --quiet --out "$work/grpo-lora" \
    --set "model.path=$fixtures/arith-sft" --set run.device=cuda --set run.steps=3 \
    --set data.prompts_per_step=8 --set data.samples_per_prompt=8 --set generate.max_new_tokens=8 \
    --set eval.arith=false --set lora.rank=8 || return 1
  test -f "$work/grpo-lora/checkpoints/step-2/actor/adapter_model.safetensors"
}

grpo_data_parallel() {
  timeout 300 "$weir" run grpo --quiet --out "$work/grpo-dp" \
    --set "model.path=$fixtures/arith-sft" --set run.device=cuda --set run.steps=3 \
    --set data.prompts_per_step=8 --set data.samples_per_prompt=8 --set generate.max_new_tokens=8 \
    --set eval.arith=false --set placement.workers=2 --set "placement.rollout=[0]" \
    --set "placement.train=[0, 1]" || return 1
  test -f "$work/grpo-dp/checkpoints/step-2/actor/model.safetensors"
}

check "model parity on cuda" parity
check "nccl weights edge" nccl
check "generation tokens/s on cuda" generation
check "generation bench on cuda (24.6M)" generation_bench
check "grpo on cuda ($count device(s))" grpo
check "grpo with lora on cuda" grpo_lora
if [ "$count" -ge 2 ]; then
  check "data-parallel learners on two cuda devices" grpo_data_parallel
fi

if [ "${#failed[@]}" -eq 0 ]; then
  echo "gpu-check: passed=$passed failed=0"
else
  echo "gpu-check: passed=$passed failed=${#failed[@]} failed: $(IFS=,; echo "${failed[*]}")"
  exit 1
fi
