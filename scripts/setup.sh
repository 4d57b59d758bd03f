#!/usr/bin/env bash
# One-time, idempotent set-up for building weir on a fresh machine:
# a project-local virtualenv holding libtorch (PyPI torch 2.11.0) for tch,
# and the `.venv/torch` symlink that `.cargo/config.toml` points LIBTORCH at.
#
# The default is the minimal CPU install (libtorch itself plus the two CUDA
# runtime libraries it links against, ~1.3 GB). WEIR_TORCH=full installs the
# full wheel with its CUDA libraries instead. A user with their own torch 2.11
# can skip this script and export LIBTORCH=<site-packages>/torch.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
torch_version="2.11.0"

if [ -n "${LIBTORCH:-}" ]; then
  echo "setup: LIBTORCH=$LIBTORCH is set; using it"
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi

site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
have=""
if [ -f "$site/torch/version.py" ]; then
  have="$(sed -n "s/^__version__ = '\([^'+]*\).*'/\1/p" "$site/torch/version.py")"
fi

# The full wheel's CUDA libraries (cuDNN among them) are missing from a minimal install.
if [ "${WEIR_TORCH:-minimal}" = "full" ] && [ "$have" = "$torch_version" ] && ! ls -d "$site"/nvidia/cudnn* >/dev/null 2>&1; then
  have="minimal"
fi

if [ "$have" != "$torch_version" ]; then
  echo "setup: installing torch==$torch_version into $venv (once)"
  if [ "${WEIR_TORCH:-minimal}" = "full" ]; then
    "$venv/bin/pip" install -q "torch==$torch_version"
  else
    "$venv/bin/pip" install -q --no-deps "torch==$torch_version" \
      nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85
  fi
fi

# cudarc dlopens `libnccl.so`; pip's NCCL wheel ships only libnccl.so.2
# (under nvidia/nccl/lib or nvidia/cu13/lib, by wheel). The link goes
# beside the one libtorch_cuda loads, so the process holds one NCCL.
for nccl_dir in "$site/nvidia/nccl/lib" "$site/nvidia/cu13/lib"; do
  if [ -f "$nccl_dir/libnccl.so.2" ] && [ ! -e "$nccl_dir/libnccl.so" ]; then
    ln -s libnccl.so.2 "$nccl_dir/libnccl.so"
  fi
done

# A relative link, so the checkout can move.
ln -sfn "${site#"$venv"/}/torch" "$venv/torch"
echo "setup: libtorch ready at $venv/torch"
