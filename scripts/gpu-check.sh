#!/usr/bin/env bash
# GPU check of the SGLang integration (issue 9): a few colocated GRPO steps with SGLang and the torch trainer on a
# randomly initialised ~0.5B Qwen2 model, on one GPU, with no network. Figures go to $OUT/gpu-check.json.
#
#   bash scripts/gpu-check.sh sglang     # on a GPU machine, from the repository root
#
# What it needs on that machine: python3 with a CUDA torch, transformers, pluggy, click, jinja2, psutil (the device
# image has them), plus sglang and torch_memory_saver. Without network, carry them as wheels in .whl/ (ignored by
# git: `echo /.whl/ >> .git/info/exclude`), downloaded on a machine with pip access, matching the machine's Python
# (3.12 on the H200 image) and its torch:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       torch_memory_saver==0.0.10 sglang==0.5.23 ...   # + sglang's kernel and runtime deps that the image lacks
#
# Note: sglang's kernel wheels (sgl-kernel, flashinfer) are several hundred MB and pinned to one torch build, so
# they exceed what a 64 MiB working-tree transfer can carry; use a container/venv with sglang installed where the
# transfer limit applies. The script installs whatever .whl/ holds and fails with one line if sglang is still absent.
#
# Two modes:
#   bash scripts/gpu-check.sh core     # a CUDA torch with transformers and pluggy + carried megatron-core and
#                                      # torch_memory_saver wheels (exactly these: README "GPU checks"):
#                                      # scripts/gpu_check_core.py (torch trainer + reference engine colocated with
#                                      # torch_memory_saver, CUDA-IPC, Megatron bf16 steps, GRPO logprob agreement);
#                                      # figures in $OUT/gpu-check-core.json; needs no sglang; < 8 minutes
#   bash scripts/gpu-check.sh sglang   # the full SGLang check below (an image with sglang installed)
# Without a GPU, `core` stops at once with one line and exit code 2.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
PY="${PYTHON:-python3}"
MODE="${1:-}"
case "$MODE" in
    core|sglang) shift ;;
    *) echo "usage: bash scripts/gpu-check.sh core|sglang [options of the mode's script]" >&2; exit 2 ;;
esac
if [ "$MODE" = core ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
then
    echo "gpu-check core: needs a CUDA GPU (torch.cuda.is_available() is False on this machine)" >&2
    exit 2
fi
mkdir -p "$OUT"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/milehpc-site \
        .whl/*.whl
    export PYTHONPATH="/tmp/milehpc-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# torch_memory_saver refuses expandable segments.
unset PYTORCH_CUDA_ALLOC_CONF

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if [ "$MODE" = core ]; then
    # 8 minutes at most: the colocated GRPO steps, the IPC hand-off and the Megatron steps take ~2-4 on one GPU.
    set +e
    timeout 480 "$PY" scripts/gpu_check_core.py --out "$OUT/gpu-check-core.json" "$@" 2>&1 \
        | tee "$OUT/gpu-check-core.log"
    rc=${PIPESTATUS[0]}
    set -e
    echo "gpu-check core: exit $rc; figures in $OUT/gpu-check-core.json"
    exit "$rc"
fi
if ! "$PY" -c "import sglang, torch_memory_saver" 2>/dev/null; then
    echo "gpu-check: sglang and torch_memory_saver must be importable (carry wheels in .whl/, see the header)" >&2
    exit 2
fi

# 10 minutes in all: engine start (~1 min with CUDA graphs), the model build, the steps and the checks.
set +e
timeout 570 "$PY" scripts/gpu_check.py --out "$OUT/gpu-check.json" "$@" 2>&1 | tee "$OUT/gpu-check.log"
rc=${PIPESTATUS[0]}
set -e
echo "gpu-check: exit $rc; figures in $OUT/gpu-check.json"
exit "$rc"
