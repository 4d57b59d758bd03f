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
#   5b. the run over two processes (generator in one, learner in the other),
#      so the weights leave device memory and cross the direct channel;
#   6. with two devices, two data-parallel learner ranks, one per device
#      (their gradient all-reduce goes device to device);
# and a last line `gpu-check: passed=<n> failed=<n> [failed: <names>]`.
# Without a CUDA device it says so in one line and exits 0.
#
# On a machine without a Rust toolchain or a network (a lent GPU machine),
# it runs from a bundle that ./scripts/gpu-bundle.sh built elsewhere
# (.gpu/bundle.tar.xz, brought along with the checkout): found when `cargo`
# is missing, or with WEIR_GPU_BUNDLE=1. libtorch then comes from that
# machine's python3 torch (WEIR_PYTHON to name another interpreter), which
# must be the 2.11 the bundle was built against.
# WEIR_GPU_CHECK_DEVICE=cpu runs every check on the CPU instead: a
# rehearsal of the script itself on a machine without a GPU.
#
#   ./scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

device="${WEIR_GPU_CHECK_DEVICE:-cuda}"
bundle=.gpu/bundle.tar.xz
unpacked=.gpu/run
if [ "${WEIR_GPU_BUNDLE:-}" = 1 ] || { ! command -v cargo >/dev/null 2>&1 && [ -f "$bundle" ]; }; then
  mode=bundle
else
  mode=build
fi

# A first look, before any set-up: no NVIDIA device node and no nvidia-smi
# that lists a GPU means there is nothing to check.
if [ "$device" = cuda ] && ! ls /dev/nvidia[0-9]* >/dev/null 2>&1 &&
  ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; }; then
  echo "gpu-check: no CUDA device here (no /dev/nvidia* and no nvidia-smi listing a GPU); nothing to check"
  exit 0
fi

if [ "$mode" = build ]; then
  export WEIR_TORCH="${WEIR_TORCH:-full}"
  ./scripts/setup.sh >/dev/null || { echo "gpu-check: set-up failed (scripts/setup.sh)"; exit 1; }
  cargo build --release --bin weir -q 2>/dev/null || { echo "gpu-check: the build failed (cargo build --release)"; exit 1; }
  weir=target/release/weir
else
  [ -f "$bundle" ] || { echo "gpu-check: no $bundle here (build it with ./scripts/gpu-bundle.sh where cargo is, and bring .gpu along)"; exit 1; }
  python="${WEIR_PYTHON:-python3}"
  # Found without importing torch (which needs its Python dependencies).
  torchdir="$("$python" -c 'import importlib.util as u; print(u.find_spec("torch").submodule_search_locations[0])' 2>/dev/null)" ||
    { echo "gpu-check: $python has no torch to take libtorch from (WEIR_PYTHON names another interpreter)"; exit 1; }
  torchlib="$torchdir/lib"
  torch_version="$(sed -n "s/^__version__ = '\([^'+]*\).*'/\1/p" "$torchdir/version.py")"
  case "$torch_version" in
    2.11.*) ;;
    *) echo "gpu-check: $python's torch is $torch_version; the bundle needs libtorch 2.11"; exit 1 ;;
  esac
  rm -rf "$unpacked" && mkdir -p "$unpacked"
  xz -dc "$bundle" | tar -C "$unpacked" -xf - || { echo "gpu-check: $bundle does not unpack"; exit 1; }
  # cudarc opens libnccl.so; the NCCL wheel has only libnccl.so.2. It must
  # be the NCCL libtorch_cuda loads (its wheel's, under nvidia/nccl/lib or
  # nvidia/cu13/lib): a second NCCL in the process (a system one, found
  # when the link is missing) mixes two versions' code and fails its first
  # collective with "corrupted comm object detected".
  nvlib="$(cd "$torchlib/../../nvidia/cu13/lib" 2>/dev/null && pwd)"
  mkdir -p .gpu/links
  for nccl in "$torchlib/../../nvidia/nccl/lib/libnccl.so.2" "$nvlib/libnccl.so.2"; do
    if [ -f "$nccl" ]; then
      ln -sfn "$(cd "$(dirname "$nccl")" && pwd)/libnccl.so.2" .gpu/links/libnccl.so
      break
    fi
  done
  export LD_LIBRARY_PATH="$torchlib${nvlib:+:$nvlib}:$PWD/.gpu/links${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The test binaries look for the weir binary and the fixtures where they
  # were built: put this checkout (tests/fixtures with it) there.
  root="$(cat "$unpacked/BUILD_ROOT")"
  if [ "$(cd "$root" 2>/dev/null && pwd -P)" != "$(pwd -P)" ]; then
    if [ -e "$root" ]; then
      echo "gpu-check: the bundle was built at $root, another folder on this machine; rebuild it from this checkout"
      exit 1
    fi
    mkdir -p "$(dirname "$root")" && ln -s "$PWD" "$root"
  fi
  weir="$(cat "$unpacked/WEIR_BIN")"
  mkdir -p "$(dirname "$weir")" && cp "$unpacked/bin/weir" "$weir"
  echo "gpu-check: from the bundle of commit $(cut -c1-10 "$unpacked/COMMIT"), libtorch from $torchlib (torch $torch_version)"
fi

devices="$("$weir" devices 2>&1)"
count="$(printf '%s\n' "$devices" | sed -n 's/^libtorch sees \([0-9]*\) CUDA.*/\1/p')"
if [ "$device" = cuda ] && [ "${count:-0}" -eq 0 ]; then
  reason="$(printf '%s\n' "$devices" | grep -i 'cuda\|error' | head -1)"
  echo "gpu-check: no CUDA device here (${reason:-libtorch sees none}); nothing to check"
  exit 0
fi
echo "gpu-check: ${count:-0} CUDA device(s), checks on $device, $mode mode"
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

fixtures="$PWD/tests/fixtures/models"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The test binaries, built here or taken from the bundle (run where cargo
# would run them: a package's tests in its folder).
tests() {
  local which="$1"
  shift
  if [ "$mode" = build ]; then
    case "$which" in
      cli) cargo test --release -q --test cli -- "$@" ;;
      gpu-lib) cargo test --release -q -p weir-gpu --lib -- "$@" ;;
      generation) cargo bench -q --bench generation ;;
    esac
  else
    case "$which" in
      cli) "$unpacked/bin/cli" -q "$@" ;;
      gpu-lib) (cd crates/gpu && "../../$unpacked/bin/gpu-lib" -q "$@") ;;
      generation) "$unpacked/bin/generation" --bench ;;
    esac
  fi
}

export mode unpacked
export -f tests

parity() {
  WEIR_TEST_DEVICE="$device" timeout 300 bash -c 'tests cli models::' 2>&1 | tail -5
  return "${PIPESTATUS[0]}"
}

nccl() {
  timeout 120 bash -c 'tests gpu-lib nccl' 2>&1 | tail -3
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
    --device "$device" --max-new-tokens 64 --ignore-eos --batch-size 64 --seed 1 || return 1
  python3 -c "import sys; t = float(sys.argv[2]) - float(sys.argv[1]); print(f'generation: 64 × 64 tokens in {t:.2f} s, {4096 / t:.0f} tokens/s (with model loading)')" "$started" "$(date +%s.%N)"
}

generation_bench() {
  WEIR_BENCH_DEVICE="$device" timeout 300 bash -c 'tests generation' 2>&1 | grep -v '^$' | tail -8
  return "${PIPESTATUS[0]}"
}

grpo() {
  local placement=(--set placement.workers=1 --set "placement.rollout=[0]" --set "placement.train=[0]")
  if [ "${count:-0}" -ge 2 ]; then
    placement=(--set placement.workers=2 --set "placement.rollout=[0]" --set "placement.train=[1]")
  fi
  timeout 300 "$weir" run grpo --quiet --out "$work/grpo" \
    --set "model.path=$fixtures/arith-sft" --set "run.device=$device" --set run.steps=4 \
    --set data.prompts_per_step=8 --set data.samples_per_prompt=8 --set generate.max_new_tokens=8 \
    --set eval.arith=false "${placement[@]}" || return 1
  test -f "$work/grpo/checkpoints/step-3/actor/model.safetensors"
}

grpo_lora() {
  timeout 300 "$weir" run grpo --quiet --out "$work/grpo-lora" \
    --set "model.path=$fixtures/arith-sft" --set "run.device=$device" --set run.steps=3 \
    --set data.prompts_per_step=8 --set data.samples_per_prompt=8 --set generate.max_new_tokens=8 \
    --set eval.arith=false --set lora.rank=8 || return 1
  test -f "$work/grpo-lora/checkpoints/step-2/actor/adapter_model.safetensors"
}

grpo_data_parallel() {
  timeout 300 "$weir" run grpo --quiet --out "$work/grpo-dp" \
    --set "model.path=$fixtures/arith-sft" --set "run.device=$device" --set run.steps=3 \
    --set data.prompts_per_step=8 --set data.samples_per_prompt=8 --set generate.max_new_tokens=8 \
    --set eval.arith=false --set placement.workers=2 --set "placement.rollout=[0]" \
    --set "placement.train=[0, 1]" || return 1
  test -f "$work/grpo-dp/checkpoints/step-2/actor/model.safetensors"
}

grpo_two_processes() {
  local hosts="$work/hosts.txt" p0 r0 r1
  python3 -c 'import socket
for _ in range(2):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); print(f"127.0.0.1:{s.getsockname()[1]}"); s.close()' >"$hosts" || return 1
  local args=(run grpo --quiet --out "$work/grpo-2p" --processes 2 --hostfile "$hosts"
    --set "model.path=$fixtures/arith-sft" --set "run.device=$device" --set run.steps=3
    --set data.prompts_per_step=8 --set data.samples_per_prompt=8 --set generate.max_new_tokens=8
    --set eval.arith=false --set placement.workers=2 --set "placement.rollout=[0]" --set "placement.train=[1]")
  timeout 300 "$weir" "${args[@]}" --process-id 0 &
  p0=$!
  timeout 300 "$weir" "${args[@]}" --process-id 1 >/dev/null
  r1=$?
  wait "$p0"
  r0=$?
  [ "$r0" -eq 0 ] && [ "$r1" -eq 0 ] || return 1
  test -f "$work/grpo-2p/checkpoints/step-2/actor/model.safetensors"
}

check "model parity on $device" parity
check "nccl weights edge" nccl
check "generation tokens/s on $device" generation
check "generation bench on $device (24.6M)" generation_bench
check "grpo on $device (${count:-0} cuda device(s))" grpo
check "grpo with lora on $device" grpo_lora
check "grpo over two processes on $device (the direct weights channel)" grpo_two_processes
if [ "${count:-0}" -ge 2 ]; then
  check "data-parallel learners on two cuda devices" grpo_data_parallel
fi

if [ "${#failed[@]}" -eq 0 ]; then
  echo "gpu-check: passed=$passed failed=0"
else
  echo "gpu-check: passed=$passed failed=${#failed[@]} failed: $(IFS=,; echo "${failed[*]}")"
  exit 1
fi
