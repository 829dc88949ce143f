"""Shared helpers of the tests that run the REAL sglang engine on the CPU (scripts/setup-sglang-cpu.sh installs it).

``require_real_sglang()`` skips with the reason (or fails under ``MILEHPC_REQUIRE_ALL=1``) when the CPU cannot run
the kernel or the setup did not install sglang / the kernel; without the vendored kernel source it skips."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
from required import unavailable

from milehpc.config.tested_versions import TESTED_GPU_PACKAGES

ROOT = Path(__file__).resolve().parents[1]
VENDOR = Path(os.environ.get("MILEHPC_SGL_KERNEL_SRC") or ROOT.parent / "shared" / "vendor" / "sglang-kernel-cpu")
TESTED = TESTED_GPU_PACKAGES["sglang"]  # the contract tests assert the version they imported


def real_sglang_missing() -> str | None:
    """Why the real engine cannot run here, or None (sglang and its CPU kernel are installed)."""
    missing = [m for m in ("sglang", "sgl_kernel") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    if not (VENDOR / "pyproject.toml").is_file():
        return f"the real sglang engine needs its CPU kernel, built from the source at {VENDOR} (absent)"
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = f" {line} "
                break
    except OSError:
        pass
    if " avx512f " not in flags and " avx2 " not in flags:
        return "the CPU kernel of sglang needs AVX-512 or AVX2 (this CPU has neither)"
    return f"{missing[0]} is not installed in this venv: run bash scripts/setup-sglang-cpu.sh"


def require_real_sglang() -> None:
    """Skip (or, under MILEHPC_REQUIRE_ALL=1, fail) when the real engine is missing. One exception: without the
    vendored kernel source beside the checkout nothing can build the kernel (it is on no package index), so that
    case skips saying so even in CI, where the setup script printed the same reason."""
    reason = real_sglang_missing()
    if reason and not (VENDOR / "pyproject.toml").is_file():
        pytest.skip(reason)
    if reason:
        unavailable(reason)
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"


def tiny_qwen2(folder: Path, *, seed: int = 0, vocab: int = 64) -> Path:
    """A tiny randomly initialised Qwen2 saved as an HF checkpoint folder (config + safetensors)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, torch_dtype="float32", bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder


def engine_args(model: Path, **extra: Any) -> dict[str, Any]:
    from milehpc.rollout.sglang_engine import CPU_SERVER_ARGS

    return {**CPU_SERVER_ARGS, "model_path": str(model), "skip_tokenizer_init": True, "dtype": "float32",
            "random_seed": 0, "log_level": "error", **extra}


def sync_over_gloo(engine: Any, named: list[tuple[str, Any]], bucket_bytes: int, version: int,
                   name: str) -> tuple[Any, int]:
    """milehpc's trainer side of a separate-ranks sync into a real SGLang ``engine``: an update group of two joined
    SGLang's way (trainer rank 0 here, in a thread), one flat uint8 broadcast per bucket (what ``StageSender.send``
    does) received by the engine's ``receive_bucket``, then ``finish_update(version)``. Returns the trainer's group
    (the caller leaves it with :func:`leave_sync_group`) and the number of buckets sent."""
    import threading

    import torch.distributed as dist

    from milehpc.comm.net import host_store
    from milehpc.rollout import sglang_mapping as sm
    from milehpc.weights.sglang import join_update_group

    store, port = host_store("127.0.0.1", f"{name}-{os.getpid()}", 2, 60.0)
    box: dict = {}
    joiner = threading.Thread(target=lambda: box.setdefault("pg", join_update_group(
        store, world_size=2, rank=0, group_name=sm.group_name(0), backend="gloo", timeout=60.0)))
    joiner.start()
    engine.begin_update()
    engine.join_update_group(master_address="127.0.0.1", master_port=port, world_size=2, stage=0, backend="gloo")
    joiner.join(60)
    pg = box["pg"]
    buckets = [sm.flatten_bucket(b) for b in sm.buckets(named, bucket_bytes)]
    for flat, meta in buckets:
        def send(flat: Any = flat) -> None:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            pg.broadcast([flat], opts).wait()
        sender = threading.Thread(target=send)
        sender.start()
        engine.receive_bucket(meta, stage=0)
        sender.join(60)
    engine.finish_update(version)
    return pg, len(buckets)


def leave_sync_group(engine: Any, pg: Any) -> None:
    """Both ends of :func:`sync_over_gloo`'s group torn down (the engine's, then the trainer's)."""
    from milehpc.rollout import sglang_mapping as sm
    from milehpc.weights.sglang import leave_update_group

    engine._call("destroy", engine._engine.destroy_weights_update_group, group_name=sm.group_name(0))
    engine.update_groups.clear()
    leave_update_group(pg)
